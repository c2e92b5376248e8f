"""Storers' writer threads are pooled per process: a storer made at a barrier hands
its batches to a parked thread instead of creating one, every byte still lands
where it was appended, whatever mix of storers and threads uses the pool, and a
forked child starts with a pool of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spillover
from spillover.storage.options import pure_selected

pytestmark = pytest.mark.skipif(pure_selected(), reason="the pool is the native writer's")


def _write_gate(
    root: Path, gate: int, buffers: list[bytes], submit_every: int, **opts: Any
) -> None:
    storage = spillover.open_storage(root, **opts)
    with storage.create_storer(gate, kind="output") as storer:
        for i, b in enumerate(buffers):
            storer.append(i % 3, b)
            if submit_every and i % submit_every == 0:
                storer.submit()  # hands the batch to a thread, as a barrier's append does
    with spillover.open_retriever(storer.close()) as r:
        assert [bytes(b) for b in r] == buffers


_COUNTING = """
import sys, time
from pathlib import Path
import spillover
from spillover._native import _storage as native

def gate(root, k, buffers, submit):
    storage = spillover.open_storage(root)
    with storage.create_storer(k) as s:
        for b in buffers:
            s.append(0, b)
            if submit:
                s.submit()
    with spillover.open_retriever(s.close()) as r:
        assert [bytes(b) for b in r] == buffers

def parked():
    deadline = time.monotonic() + 30
    while native.writer_pool_stats()[1] < 1:
        assert time.monotonic() < deadline, "no writer thread came back to the pool"
        time.sleep(0.001)

root = Path(sys.argv[1])
"""


def _counting(tmp_path: Path, body: str) -> None:
    """Runs ``body`` after :data:`_COUNTING` in a process of its own: the pool's counts
    are the process's, which another test's storers must not move."""
    out = subprocess.run(
        [sys.executable, "-c", _COUNTING + body, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


def test_storers_made_one_after_another_share_one_writer_thread(tmp_path: Path) -> None:
    _counting(
        tmp_path,
        """
gate(root / "warm", 0, [b"w" * 100], True)
parked()  # the one thread there is, back in the pool
for k in range(20):
    gate(root / str(k), k, [bytes([k]) * 5000, b"", bytes([k]) * 70], True)
    parked()  # back before the next storer: it is the one that storer takes
assert native.writer_pool_stats()[0] == 1, native.writer_pool_stats()
""",
    )


def test_a_gate_closed_before_any_batch_filled_needs_no_thread(tmp_path: Path) -> None:
    _counting(
        tmp_path,
        """
for k in range(10):
    gate(root / str(k), k, [b"small" * 10, b"frames"], False)
assert native.writer_pool_stats() == (0, 0), native.writer_pool_stats()
""",
    )


def test_one_thread_filling_two_storers_in_turn(tmp_path: Path) -> None:
    """Two storers of one task (an input and an output gate) each hold a pool thread
    at once; neither waits for the other's."""
    storage = spillover.open_storage(tmp_path)
    a, b = storage.create_storer(0), storage.create_storer(0, kind="output")
    sent: dict[int, list[bytes]] = {0: [], 1: []}
    for i in range(40):
        for k, s in enumerate((a, b)):
            payload = bytes([i, k]) * (1000 + 997 * i)
            s.append(0, payload)
            s.submit()
            sent[k].append(payload)
    for k, s in enumerate((a, b)):
        with spillover.open_retriever(s.close()) as r:
            assert [bytes(x) for x in r] == sent[k]


def test_callback_and_ring_storers_go_through_the_pool(tmp_path: Path) -> None:
    """A pyarrow filesystem's storer writes through a callback on its pool thread, and a
    non-blocking storer (a ring) holds a thread from the start: both get every byte."""
    import pyarrow.fs

    buffers = [os.urandom(n) for n in (0, 10, 70_000, 300_000, 5)]
    _write_gate(tmp_path / "arrow", 1, buffers, 1, filesystem=pyarrow.fs.LocalFileSystem())
    _write_gate(tmp_path / "ring", 2, buffers, 2, blocking=False, pool_bytes=1 << 16)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    gates=st.lists(
        st.tuples(
            st.lists(st.binary(max_size=3000), max_size=12),
            st.integers(0, 3),  # submit every n-th buffer (0: never)
            st.booleans(),  # discarded instead of closed
        ),
        min_size=1,
        max_size=8,
    ),
    threads=st.integers(1, 4),
)
def test_storers_on_many_threads_get_every_byte_back(
    tmp_path_factory: pytest.TempPathFactory,
    gates: list[tuple[list[bytes], int, bool]],
    threads: int,
) -> None:
    root = tmp_path_factory.mktemp("pool")
    failures: list[BaseException] = []
    written: dict[int, tuple[Path, list[bytes]]] = {}

    def run(share: list[int]) -> None:
        try:
            for g in share:
                buffers, every, discard = gates[g]
                storage = spillover.open_storage(root / str(g))
                storer = storage.create_storer(g)
                for i, b in enumerate(buffers):
                    storer.append(0, b)
                    if every and i % every == 0:
                        storer.submit()
                if discard:
                    storer.discard()
                    assert not Path(storer.uri).exists()
                else:
                    handle = storer.close()
                    written[g] = (Path(handle.uri), buffers)
        except BaseException as e:  # reported on the test's thread
            failures.append(e)

    shares = [list(range(k, len(gates), threads)) for k in range(threads)]
    workers = [threading.Thread(target=run, args=(s,)) for s in shares]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert not w.is_alive(), "a storer hung"
    assert not failures, failures
    assert len(written) == sum(1 for _, _, discard in gates if not discard)
    for g, (path, buffers) in written.items():
        handle = spillover.open_storage(path.parent).create_retriever(g)
        with handle as r:
            assert [bytes(b) for b in r] == buffers


def test_a_storer_discarded_while_its_thread_writes_lets_it_go(tmp_path: Path) -> None:
    storage = spillover.open_storage(tmp_path)
    for k in range(5):
        storer = storage.create_storer(k)
        for _ in range(64):
            storer.append(0, b"z" * 65536)
            storer.submit()
        storer.discard()  # the thread drops what is queued and parks again
        assert not Path(storer.uri).exists()
    _write_gate(tmp_path / "after", 9, [b"still works"], 1)


def test_a_forked_child_writes_with_a_pool_of_its_own(tmp_path: Path) -> None:
    """The parent's parked threads are not in the child: the child hands its writers to
    none of them (it would wait for ever), and freeing a storer it inherited mid-write
    does not wait for a thread that stayed in the parent."""
    code = f"""
import os, signal, sys, time
import spillover
from spillover._native import _storage as native

def gate(root, k):
    storage = spillover.open_storage(root)
    with storage.create_storer(k) as s:
        s.append(0, b"x" * 70000)
        s.submit()
        s.append(1, b"y" * 10)
    with spillover.open_retriever(s.close()) as r:
        assert [bytes(b) for b in r] == [b"x" * 70000, b"y" * 10]

gate({str(tmp_path / "parent")!r}, 0)
while native.writer_pool_stats()[1] < 1:
    time.sleep(0.001)  # a thread is parked in the parent
busy = spillover.open_storage({str(tmp_path / "busy")!r}).create_storer(5)
for _ in range(32):
    busy.append(0, b"b" * 65536)
    busy.submit()  # its thread is writing when the process forks
pid = os.fork()
if pid == 0:
    signal.alarm(50)  # a child that hangs dies before the test gives up on it
    try:
        assert native.writer_pool_stats() == (0, 0), native.writer_pool_stats()
        gate({str(tmp_path / "child")!r}, 1)
        assert native.writer_pool_stats()[0] == 1, native.writer_pool_stats()
        busy._native.discard()  # frees the inherited writer: its thread is not here
    except BaseException as e:
        print(repr(e), file=sys.stderr)
        os._exit(1)
    os._exit(0)
_, status = os.waitpid(pid, 0)
with spillover.open_retriever(busy.close()) as r:  # the parent's storer is whole
    assert sum(len(b) for b in r) == 32 * 65536
sys.exit(os.waitstatus_to_exitcode(status))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
