"""The storage extension's own promises: bytes it hands out are read-only while
anything points into them, every exporter refuses writable views, and a debug
build counts its native handles back to zero."""

from __future__ import annotations

import gc
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import spillover
from spillover._native import _storage as native


def _writable(obj: object, n: int) -> None:
    struct.pack_into("B", obj, 0, 1)  # takes a writable view (PyBUF_WRITABLE) and writes


def _state_file(tmp_path: Path) -> bytes:
    storage = spillover.open_storage(tmp_path)
    with storage.create_storer(0) as st:
        st.append(0, b"a" * 100)
        st.append(1, b"b" * 50)
    return Path(st.close().uri).read_bytes()


def test_a_block_is_writable_only_while_nothing_points_into_it(tmp_path: Path) -> None:
    data = _state_file(tmp_path)
    frames = data[native.HEADER_SIZE : len(data) - native.TRAILER_SIZE]
    block = native.Block(4096)
    view = memoryview(block)  # a fresh block: filled by the reader
    assert not view.readonly
    view[: len(frames)] = frames
    view.release()
    batch = native.scan_block(block, len(frames), native.HEADER_SIZE, True, None, "f")[0]
    buf = batch.next()
    assert bytes(buf) == b"a" * 100 and block.users > 0
    assert memoryview(block).readonly  # what the buffers point at cannot change
    with pytest.raises((BufferError, TypeError)):
        _writable(block, 16)
    assert bytes(memoryview(block)[: len(frames)]) == frames  # reading is fine
    del buf, batch
    gc.collect()
    assert block.users == 0
    _writable(block, 16)  # nothing points into it any more


def test_retrieved_buffers_batches_and_released_buffers_refuse_writable_views(
    tmp_path: Path,
) -> None:
    storage = spillover.open_storage(tmp_path)
    with storage.create_storer(0) as st:
        st.append(0, b"payload")
    with spillover.open_retriever(st.close()) as r:
        buf = next(iter(r))
        assert memoryview(buf).readonly
        with pytest.raises((BufferError, TypeError)):
            _writable(buf, len(buf))
    released: list[bool] = []
    held = native.OnRelease(bytearray(b"abc"), lambda: released.append(True))
    assert memoryview(held).readonly
    with pytest.raises((BufferError, TypeError)):
        _writable(held, 3)
    assert bytes(memoryview(held)) == b"abc"


def test_a_debug_build_frees_every_native_handle(tmp_path: Path) -> None:
    before = native.live_handles()
    if before < 0:
        pytest.skip(
            "a release build counts nothing (make debug-test builds with SPILLOVER_DEBUG=1)"
        )
    storage = spillover.open_storage(tmp_path)
    with storage.create_storer(0) as st:
        st.append(0, b"x" * 10_000)
        assert native.live_handles() > before  # the writer is counted
    with spillover.open_retriever(st.close(), read_block_bytes=4096) as r:
        assert [bytes(b) for b in r] == [b"x" * 10_000]
    del r, st
    gc.collect()
    assert native.live_handles() == before


def test_embedding_the_engine_loads_neither_pyarrow_nor_the_pure_twin() -> None:
    """``import spillover`` for local files stays light: pyarrow (tens of MB) loads only
    for a remote location, the pure-Python twin only with SPILLOVER_PURE=1."""
    code = (
        "import sys, tempfile, spillover\n"
        "d = tempfile.mkdtemp()\n"
        "with spillover.open_storage(d).create_storer(0) as st:\n"
        "    st.append(0, b'x')\n"
        "list(spillover.open_retriever(st.close()))\n"
        "print(sorted(m for m in ('pyarrow', 'spillover.storage.pure') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("blocking", [True, False])
def test_a_failed_stream_write_fails_close_and_never_hangs_it(
    tmp_path: Path, blocking: bool
) -> None:
    """A write error of a pyarrow stream surfaces as a StorageError, at close at the
    latest. (When the error landed just as close submitted the last batch, that
    batch never woke the writer's thread and close waited for ever: a race seen
    under load, which the storage-fault tests' write case runs into.)"""
    import errno as errno_mod

    from spillover.errors import StorageError
    from spillover.storage import open_storage
    from support.faults import fail, faulty_dir

    with faulty_dir(str(tmp_path)) as (uri, faults):
        storage = open_storage(uri, blocking=blocking)
        storer = storage.create_storer(0)
        storer.append(1, b"x" * 1000)
        storer.flush()  # the writer's thread is idle now
        faults.rules = [fail({"write"}, "", lambda: OSError(errno_mod.EIO, "injected"))]
        for _ in range(200):
            try:
                storer.append(1, b"y" * 40_000)
            except StorageError:
                break
        with pytest.raises(StorageError, match="injected"):
            storer.close()
