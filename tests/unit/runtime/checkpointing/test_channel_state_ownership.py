"""A state file that cannot take a buffer never costs that buffer a reference its
writer does not own.

Found by ``spillover chaos`` (1-98): an aligned-with-timeout checkpoint switched to
unaligned and persisted the buffers its barrier overtook, which stay queued in their
input channel; storage had failed (an aborted savepoint), the failing append
released the buffer twice, so it was recycled while still queued, and cancelling the
attempt's input gate raised ``BufferReleasedError: buffer released twice``.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from spillover.errors import StorageError
from spillover.runtime.batch.results import ResultWriter
from spillover.runtime.checkpointing.channel_state import ChannelStateWriter
from spillover.runtime.checkpointing.inflight import barrier_of
from spillover.runtime.network.buffers import BufferPool
from spillover.runtime.network.events import BarrierKind, CheckpointBarrier
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.local import connect
from spillover.runtime.network.partition import ResultPartition
from spillover.storage import Storage, open_storage


class RefusingStorer:
    """A storer whose appends fail, as a native one does once its I/O thread hit
    ENOSPC: ``append`` raises before (or after) it looked at the buffer, and keeps
    nothing of it."""

    def __init__(self, look: bool) -> None:
        self.look = look

    def append(self, channel: int, buffer: Any, data_type: int = 0) -> None:
        if self.look:
            memoryview(buffer).release()
        del buffer  # kept by no traceback, as in the native storer
        raise StorageError("writing the state file failed", errno=errno.ENOSPC)

    def submit(self) -> None: ...

    def reap(self) -> None: ...

    def discard(self) -> None: ...


@pytest.mark.parametrize("look", [False, True], ids=["before-view", "after-view"])
def test_a_failing_append_leaves_an_overtaken_buffer_to_its_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, look: bool
) -> None:
    monkeypatch.setattr(Storage, "create_storer", lambda *a, **k: RefusingStorer(look))
    pool = BufferPool(8, 2)
    part = ResultPartition(1, pool, "p")
    gate = InputGate(1, floating_buffers=0, buffers_per_channel=2)
    connect(part, 0, gate, 0)
    part.emit(0, pool.wrap(b"\x01"))
    part.broadcast_event(CheckpointBarrier(1, 0, BarrierKind.ALIGNED_WITH_TIMEOUT, 10))
    # The alignment timed out: the barrier overtakes the buffer, which stays queued.
    ahead = gate.overtake(0, barrier_of(1))
    assert ahead is not None and len(ahead) == 1
    writer = ChannelStateWriter(str(tmp_path), 1, 0, None)
    for b in ahead:
        writer.add_input(0, 0, b)
        b.release()
    assert isinstance(writer.failed, StorageError)  # the checkpoint is declined
    assert ahead[0].refs == 1  # the queue's own reference
    gate.cancel()  # the attempt ends: the queue lets go of it, once
    assert pool.available == pool.num_segments


def test_a_failing_result_file_append_releases_the_buffer_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(Storage, "create_storer", lambda *a, **k: RefusingStorer(False))
    pool = BufferPool(8, 1)
    buf = pool.wrap(b"\x02")
    held = buf.retain()  # another holder, as a broadcast's next subpartition
    writer = ResultWriter(open_storage(tmp_path, checkpoint_id=1), 0, 1)
    with pytest.raises(StorageError):
        writer.append(0, buf)
    assert held.refs == 1
    held.release()
    assert pool.available == 1
