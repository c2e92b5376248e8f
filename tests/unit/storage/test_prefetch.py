"""Starting a state file's first reads ahead of its open: the range it names, and a
hint that never fails the read it precedes."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from spillover._native import _storage as native
from spillover.storage import (
    GateStateHandle,
    frames_range,
    open_retriever,
    open_storage,
    prefetch_start,
)


def _gate(tmp_path: Path) -> GateStateHandle:
    storer = open_storage(tmp_path, checkpoint_id=1, subtask_index=0).create_storer(0)
    for i in range(40):
        storer.append(i % 3, bytes([i]) * 1000)
    return storer.close()


def test_frames_range_is_what_a_retriever_reads(tmp_path: Path) -> None:
    h = _gate(tmp_path)
    assert frames_range(h) == (native.HEADER_SIZE, h.size - native.TRAILER_SIZE)
    assert frames_range(h, [1]) == h.byte_range([1])
    section = dataclasses.replace(h, offset=4096)
    start, end = h.byte_range([2]) or (0, 0)
    assert frames_range(section, [2]) == (4096 + start, 4096 + end)


def test_prefetch_leaves_the_read_unchanged(tmp_path: Path) -> None:
    h = _gate(tmp_path)
    with open_retriever(h) as r:
        before = [(b.channel_id, bytes(b)) for b in r]
    prefetch_start(h)
    prefetch_start(h, [0, 2], nbytes=1)
    with open_retriever(h) as r:
        assert [(b.channel_id, bytes(b)) for b in r] == before


def test_prefetch_of_a_missing_or_foreign_file_is_ignored(tmp_path: Path) -> None:
    h = _gate(tmp_path)
    os.unlink(h.uri)
    prefetch_start(h)  # the open that follows reports the missing file, not the hint
    prefetch_start(dataclasses.replace(h, uri="memory://nowhere/in-00000.spill"))
