"""The golden checkpoint metadata of every metadata version (tests/golden/checkpoint/):
the simulated two-operator job at parallelism 2, as version 1 wrote it (every gate's
per-channel maps inline), as version 2 wrote it (the maps in ``_channel_index``
beside ``_metadata``) and as version 3 writes it (the maps in index sections of the
groups' shared files, which the tasks wrote: ``channels/<group>.spill`` holds only
them here, each at the offset its gate names, zeros where the frames would be).
``tools/make_golden.py`` writes them; the tests read them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spillover.runtime.checkpointing.checkpoint_meta import (
    ChannelStateMeta,
    CheckpointMetadata,
    OperatorMeta,
    SubtaskMeta,
    graph_from_json,
)
from spillover.runtime.checkpointing.metadata import (
    CheckpointStorage,
    encode_metadata,
    new_metadata,
    split_channel_index,
)
from spillover.runtime.checkpointing.simulated import GROUP, SimulatedJob
from spillover.storage.channel_index import INDEX_ENTRY, INDEX_FILE, encode_entry, resolve_all
from spillover.storage.handle import GateStateHandle

GOLDEN_CHECKPOINTS = Path(__file__).resolve().parent.parent / "golden" / "checkpoint"
ROOT = "/golden/ckpt"  # where the golden checkpoint's files were (they are not)
CHECKPOINT_ID = 7
JOB = SimulatedJob(2, max_parallelism=128, fill=0.5, frames=1)


def carried_entry(handle: GateStateHandle) -> dict[str, Any]:
    """A gate as a version 2 acknowledgement carried it: the handle without its maps
    and, under ``index_entry``, those maps encoded (the coordinator wrote them into
    ``_channel_index``)."""
    d = dataclasses.replace(handle, channels={}, channel_ranges={}, index=None).to_dict()
    del d["channels"]
    d[INDEX_ENTRY] = encode_entry(handle)
    return d


def _metadata(
    gate: Callable[[GateStateHandle], dict[str, Any]] | None, version: int
) -> CheckpointMetadata:
    """The golden checkpoint, each gate's handle given by ``gate`` (None: as the
    tasks acknowledge it now, naming the entry they wrote)."""
    storage = CheckpointStorage(ROOT, "sim")
    subtasks: dict[str, dict[int, SubtaskMeta]] = {}
    for key in JOB.subtask_keys():
        ack = JOB.ack(storage, CHECKPOINT_ID, key)
        cs = ack.channel_state
        if gate is not None:
            for side in ("input", "output"):
                cs[side] = [
                    gate(JOB.gate(storage.checkpoint_dir(CHECKPOINT_ID), key[0], key[1], 0))
                    for _ in cs[side]
                ]
        subtasks.setdefault(key[0], {})[key[1]] = SubtaskMeta(
            ack.operator_state,
            ack.keyed,
            ack.handles,
            ChannelStateMeta.from_json(cs),
            ack.metrics,
        )
    meta = new_metadata(
        job_name="sim",
        checkpoint_id=CHECKPOINT_ID,
        trigger_ms=1_700_000_000_000,
        fingerprint="sim",
        settings={"max-parallelism": JOB.max_parallelism},
        tasks={uid: OperatorMeta(subs, 2) for uid, subs in subtasks.items()},
        final=False,
        graph=graph_from_json(JOB.graph()),
    )
    return dataclasses.replace(meta, version=version, completed_ms=1_700_000_000_123)


def golden_files() -> dict[str, bytes]:
    """``{path under tests/golden/checkpoint: bytes}``: what ``write_metadata`` writes."""
    chk = f"chk-{CHECKPOINT_ID}"
    v1 = _metadata(GateStateHandle.to_dict, 1).to_json()
    v2, index = split_channel_index(_metadata(carried_entry, 2), f"{ROOT}/sim/{chk}/{INDEX_FILE}")
    v3, none = split_channel_index(_metadata(None, 3), f"{ROOT}/sim/{chk}/{INDEX_FILE}")
    assert not none  # version 3 writes no channel index
    files = {
        f"v1/{chk}/_metadata": encode_metadata(v1),
        f"v2/{chk}/_metadata": encode_metadata(v2),
        f"v2/{chk}/{INDEX_FILE}": index,
        f"v3/{chk}/_metadata": encode_metadata(v3),
    }
    storage = CheckpointStorage(ROOT, "sim")
    for uid in {k[0] for k in JOB.subtask_keys()}:
        for first in range(0, JOB.parallelism, GROUP):
            placed = JOB.placed(storage.checkpoint_dir(CHECKPOINT_ID), uid, first)
            last, entry = placed[-1]
            assert last.index is not None
            data = bytearray(last.index.offset + len(entry))
            for h, e in placed:
                assert h.index is not None
                data[h.index.offset : h.index.offset + len(e)] = e
            files[f"v3/{chk}/channels/{Path(last.uri).name}"] = bytes(data)
    return files


def golden_dir(version: int) -> Path:
    """Where the golden checkpoint of ``version`` lies (its ``chk-<id>``'s parent)."""
    return GOLDEN_CHECKPOINTS / f"v{version}"


def relocated(raw: dict[str, Any], version: int) -> dict[str, Any]:
    """Golden metadata JSON ``raw`` with the files it names moved from where they were
    written (:data:`ROOT`) to where the golden files lie, as an export does."""
    text = json.dumps(raw).replace(f"{ROOT}/sim/", f"{golden_dir(version)}/")
    out: dict[str, Any] = json.loads(text)
    return out


def inlined(meta: CheckpointMetadata) -> CheckpointMetadata:
    """``meta`` with every gate's channel maps inline (read from the channel index),
    and no channel index."""

    def inline(cs: ChannelStateMeta | None) -> ChannelStateMeta | None:
        if cs is None:
            return None
        return dataclasses.replace(
            cs, input=tuple(resolve_all(cs.input)), output=tuple(resolve_all(cs.output))
        )

    tasks = {
        uid: dataclasses.replace(
            op,
            subtasks={
                i: dataclasses.replace(st, channel_state=inline(st.channel_state))
                for i, st in op.subtasks.items()
            },
        )
        for uid, op in meta.tasks.items()
    }
    return dataclasses.replace(meta, channel_index=None, tasks=tasks)


def as_version_1(raw: dict[str, Any]) -> dict[str, Any]:
    """Version 2 metadata as version 1 wrote it: every gate's channel maps inline
    (read from the channel index), no channel index."""
    return dataclasses.replace(inlined(CheckpointMetadata.from_json(raw)), version=1).to_json()


def empty_metadata(checkpoint_id: int) -> CheckpointMetadata:
    """The metadata of a checkpoint of job ``j`` that holds no task: for tests of
    where metadata goes and how it is listed, not of what it says."""
    from spillover.runtime.checkpointing.metadata import new_metadata

    return new_metadata(
        job_name="j", checkpoint_id=checkpoint_id, trigger_ms=0, fingerprint="f",
        settings={}, tasks={}, final=False,
    )  # fmt: skip


def as_version_2(raw: dict[str, Any], index_uri: str) -> tuple[dict[str, Any], bytes]:
    """Metadata of version 2 or 3 as version 2 wrote it: its JSON and the bytes of
    the channel index ``index_uri`` beside it, every gate's maps an entry there."""

    def carried(cs: ChannelStateMeta | None) -> ChannelStateMeta | None:
        if cs is None:
            return None
        return dataclasses.replace(
            cs,
            input=tuple(GateStateHandle.from_dict(carried_entry(h)) for h in cs.input),
            output=tuple(GateStateHandle.from_dict(carried_entry(h)) for h in cs.output),
        )

    meta = inlined(CheckpointMetadata.from_json(raw))
    tasks = {
        uid: dataclasses.replace(
            op,
            subtasks={
                i: dataclasses.replace(st, channel_state=carried(st.channel_state))
                for i, st in op.subtasks.items()
            },
        )
        for uid, op in meta.tasks.items()
    }
    return split_channel_index(dataclasses.replace(meta, version=2, tasks=tasks), index_uri)
