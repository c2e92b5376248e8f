"""The storage engine (native writer and streaming retriever) against the format spec.

The pure-Python reference implementation is the oracle: files written natively must
read back through it, and files it writes must read back natively.
"""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spillover
from spillover._native import _storage as native
from spillover.errors import (
    ClosedError,
    ConfigError,
    ForeignFileError,
    FormatError,
    SpilloverError,
    StateFileExistsError,
    StateFileNotFoundError,
    StorageError,
    TruncatedFileError,
)
from spillover.storage import check_ends, reference
from support.format_fuzz import (
    FrameTuple,
    check_every_cut_truncated,
    check_golden,
    frame_lists,
    fuzz_reader,
    load_golden,
)

MODES = [
    pytest.param({"blocking": True}, id="blocking"),
    pytest.param({"blocking": False, "pool_bytes": 256 * 1024}, id="nonblocking"),
]
CODECS = [pytest.param(None, id="raw"), pytest.param("lz4", id="lz4")]


def native_read(data: bytes, path: str) -> list[FrameTuple]:
    """Reads a whole file through the native retriever (the fuzz helpers' reader shape)."""
    d = Path(os.environ["SPILLOVER_TEST_TMP"])
    f = d / os.path.basename(path)
    f.write_bytes(data)
    try:
        with spillover.open_retriever(str(f), read_block_bytes=4096, read_ahead_bytes=8192) as r:
            return [(b.channel_id, b.data_type, bytes(b)) for b in r]
    except SpilloverError as e:
        e.path = path  # the fuzz helpers check the path they passed
        raise


@pytest.fixture(autouse=True)
def _tmp_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPILLOVER_TEST_TMP", str(tmp_path))


def write_native(
    path: Path, frames: list[FrameTuple], codec: str | None = None, **opts: Any
) -> spillover.GateStateHandle:
    storage = spillover.open_storage(path, compression=codec, **opts)
    with storage.create_storer(0) as st:
        for channel, dtype, payload in frames:
            st.append(channel, payload, dtype)
    return st.close()


# --- crc ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=20000), split=st.integers(0, 20000))
def test_crc32c_matches_reference_and_extends(data: bytes, split: int) -> None:
    split = min(split, len(data))
    assert native.crc32c(data) == reference.crc32c(data)
    assert native.crc32c(data[split:], native.crc32c(data[:split])) == native.crc32c(data)


def test_crc32c_check_value_and_large_buffers() -> None:
    assert native.crc32c(b"123456789") == 0xE3069283
    big = np.random.default_rng(1).integers(0, 256, 3 * 1024 * 1024 + 13, dtype=np.uint8)
    assert native.crc32c(big) == reference.crc32c(big.tobytes())


# --- round trips against the reference oracle -----------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("codec", CODECS)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frames=frame_lists(max_frames=12))
def test_native_write_reads_back_in_both_readers(
    tmp_path: Path, mode: dict[str, Any], codec: str | None, frames: list[FrameTuple]
) -> None:
    d = tmp_path / os.urandom(4).hex()
    handle = write_native(d, frames, codec, **mode)
    data = Path(handle.uri).read_bytes()
    _header, ref_frames = reference.read_state_file(data, path=handle.uri)
    assert [(f.channel_id, f.data_type, f.data) for f in ref_frames] == frames
    assert native_read(data, "x.spill") == frames
    assert handle.size == len(data)
    assert handle.frame_count == len(frames)
    assert handle.raw_bytes == sum(len(p) for _, _, p in frames)
    per_channel: dict[int, list[int]] = {}
    for c, _, p in frames:
        per_channel.setdefault(c, [0, 0])
        per_channel[c][0] += 1
        per_channel[c][1] += len(p)
    assert handle.channels == {c: (v[0], v[1]) for c, v in per_channel.items()}


def test_golden_files_read_natively() -> None:
    check_golden(native_read)


@pytest.mark.parametrize("mode", MODES)
def test_native_writer_reproduces_golden_bytes(tmp_path: Path, mode: dict[str, Any]) -> None:
    """Given the golden files' header fields and buffers, the native writer writes the same
    bytes as the reference writer did."""
    import lz4.block

    for golden in load_golden():
        h = golden.header
        file_id = h["file_id"]
        header = native.encode_state_header(
            h["checkpoint_id"],
            h["subtask_index"],
            h["gate_id"],
            h["gate_kind"],
            h["codec"],
            file_id,
        )
        out = io.BytesIO()
        st = native.NativeStorer(
            -1,
            out.write,
            header,
            file_id,
            lz4.block.compress if h["codec"] else None,
            4096,
            0 if mode["blocking"] else 65536,
            "golden",
        )
        for f in golden.frames:
            st.append(f.channel_id, f.payload, f.data_type)
        st.finish(False)
        assert out.getvalue() == golden.path.read_bytes(), golden.name


# --- damaged files ----------------------------------------------------------------------


def test_fuzzed_files_read_back_exactly_or_fail_cleanly() -> None:
    fuzz_reader(native_read, max_examples=150)


def test_every_cut_of_a_file_is_truncated() -> None:
    frames = [(1, 0, b"abc" * 10), (2, 1, b""), (1, 0, bytes(range(200)))]
    buf = io.BytesIO()
    with reference.ReferenceWriter(buf) as w:
        for c, t, p in frames:
            w.append(c, p, t)
    check_every_cut_truncated(native_read, buf.getvalue())


def test_unclosed_file_is_refused_before_any_buffer(tmp_path: Path) -> None:
    storage = spillover.open_storage(tmp_path)
    st = storage.create_storer(0)
    st.append(0, b"x" * 100_000)
    st.flush()  # bytes on disk, but no trailer: the storer never closed
    with pytest.raises(TruncatedFileError) as ei:
        storage.create_retriever(0)
    assert ei.value.path == st.uri and ei.value.offset is not None
    st.discard()
    assert not Path(st.uri).exists()


def test_foreign_file_is_refused_by_handle(tmp_path: Path) -> None:
    a = write_native(tmp_path / "a", [(0, 0, b"one")])
    b = write_native(tmp_path / "b", [(0, 0, b"two")])
    os.replace(b.uri, a.uri)
    with pytest.raises(ForeignFileError) as ei:
        spillover.open_retriever(a)
    assert isinstance(ei.value, ValueError) and ei.value.path == a.uri


def test_check_ends_reads_only_a_files_ends(tmp_path: Path) -> None:
    """check_ends refuses a missing, cut, foreign or badly ended file, and passes one
    whose frames alone are damaged: those a reader finds as it reads them."""
    h = write_native(tmp_path / "a", [(c % 3, 0, bytes([c]) * 5000) for c in range(20)])
    check_ends(h)
    path = Path(h.uri)
    data = path.read_bytes()
    body = bytearray(data)
    body[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(body))
    check_ends(h)  # the frames are not read...
    with pytest.raises(FormatError), spillover.open_retriever(h) as r:  # ...a reader does
        list(r)
    end = bytearray(data)
    end[-40] ^= 0x01  # the trailer's frame count
    path.write_bytes(bytes(end))
    with pytest.raises(SpilloverError):
        check_ends(h)
    path.write_bytes(data[:-1])
    with pytest.raises(SpilloverError):
        check_ends(h)
    path.write_bytes(data)
    check_ends(h)
    foreign = spillover.GateStateHandle.from_dict({**h.to_dict(), "file_id": "00" * 16})
    with pytest.raises(ForeignFileError):
        check_ends(foreign)
    other_sums = spillover.GateStateHandle.from_dict({**h.to_dict(), "frame_count": 2})
    with pytest.raises(ForeignFileError, match="trailer"):
        check_ends(other_sums)
    path.unlink()
    with pytest.raises(StateFileNotFoundError):
        check_ends(h)


def test_missing_file(tmp_path: Path) -> None:
    storage = spillover.open_storage(tmp_path)
    with pytest.raises(StateFileNotFoundError) as ei:
        storage.create_retriever(3, kind="output")
    assert isinstance(ei.value, FileNotFoundError)
    assert ei.value.path is not None and ei.value.path.endswith("out-00003.spill")


def test_storer_refuses_to_overwrite(tmp_path: Path) -> None:
    write_native(tmp_path, [(0, 0, b"keep me")])
    with pytest.raises(StateFileExistsError):
        spillover.open_storage(tmp_path).create_storer(0)
    assert native_read(Path(tmp_path / "in-00000.spill").read_bytes(), "a") == [(0, 0, b"keep me")]


# --- the storer's contract ---------------------------------------------------------------


BUFFER_KINDS = {
    "bytes": lambda b: bytes(b),
    "bytearray": lambda b: bytearray(b),
    "memoryview": lambda b: memoryview(b),
    "numpy": lambda b: np.frombuffer(b, dtype=np.uint8).copy(),
    "numpy-2d": lambda b: np.frombuffer(b, dtype=np.uint8).reshape(len(b) // 8, 8).copy(),
    "pyarrow": lambda b: pa.py_buffer(b),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(BUFFER_KINDS))
def test_append_takes_any_contiguous_buffer(
    tmp_path: Path, mode: dict[str, Any], kind: str
) -> None:
    payload = os.urandom(4096)
    handle = write_native(tmp_path, [(5, 0, BUFFER_KINDS[kind](payload))], **mode)
    assert native_read(Path(handle.uri).read_bytes(), "a") == [(5, 0, payload)]


def test_failed_append_keeps_storer_and_data_intact(tmp_path: Path) -> None:
    storage = spillover.open_storage(tmp_path)
    st = storage.create_storer(0)
    st.append(0, b"first")
    strided = np.arange(100, dtype=np.uint8)[::2]
    with pytest.raises(BufferError):
        st.append(0, strided)
    with pytest.raises(ValueError):
        st.append(0, b"x", 7)
    with pytest.raises((OverflowError, ValueError)):
        st.append(-1, b"x")
    with pytest.raises(TypeError):
        st.append(0, "text is not a buffer")
    st.append(1, b"second")
    handle = st.close()
    assert handle.frame_count == 2
    assert native_read(Path(handle.uri).read_bytes(), "a") == [(0, 0, b"first"), (1, 0, b"second")]


@pytest.mark.native_only
def test_blocking_mode_holds_buffers_without_copying_until_flush(tmp_path: Path) -> None:
    st = spillover.open_storage(tmp_path).create_storer(0)
    buf = bytearray(b"a" * 1000)
    st.append(0, buf)
    with pytest.raises(BufferError):  # held by the storer: no resize while it is queued
        buf.extend(b"more")
    st.flush()
    buf.extend(b"more")  # released once written
    st.close()


def test_nonblocking_mode_copies_so_buffer_can_be_reused(tmp_path: Path) -> None:
    st = spillover.open_storage(tmp_path, blocking=False).create_storer(0)
    buf = bytearray(b"a" * 1000)
    st.append(0, buf)
    buf[:] = b"b" * 1000
    st.append(0, buf)
    handle = st.close()
    got = native_read(Path(handle.uri).read_bytes(), "a")
    assert got == [(0, 0, b"a" * 1000), (0, 0, b"b" * 1000)]


def test_nonblocking_pool_bounds_memory_and_handles_buffers_larger_than_pool(
    tmp_path: Path,
) -> None:
    big = os.urandom(1024 * 1024)
    handle = write_native(
        tmp_path, [(0, 0, big), (1, 0, b"tail")], blocking=False, pool_bytes=64 * 1024
    )
    assert native_read(Path(handle.uri).read_bytes(), "a") == [(0, 0, big), (1, 0, b"tail")]


def test_append_after_close(tmp_path: Path) -> None:
    st = spillover.open_storage(tmp_path).create_storer(0)
    handle = st.close()
    assert st.close() == handle  # closing twice returns the same handle
    with pytest.raises(ClosedError) as ei:
        st.append(0, b"late")
    assert isinstance(ei.value, RuntimeError)


def test_with_block_discards_on_error(tmp_path: Path) -> None:
    storage = spillover.open_storage(tmp_path)
    with pytest.raises(KeyError), storage.create_storer(0) as st:
        st.append(0, b"x")
        raise KeyError("boom")
    assert storage.gates() == []


@pytest.mark.parametrize("mode", MODES)
def test_io_error_is_sticky_and_names_the_file(mode: dict[str, Any]) -> None:
    """A failing sink surfaces as StorageError on a later call, keeps errno, never hangs."""
    calls = []

    def failing_write(data: Any) -> None:
        calls.append(len(data))
        raise OSError(28, "No space left on device")

    file_id = bytes(16)
    header = native.encode_state_header(0, 0, 0, 0, 0, file_id)
    st = native.NativeStorer(
        -1,
        failing_write,
        header,
        file_id,
        None,
        4096,
        0 if mode["blocking"] else 65536,
        "s3://bucket/f.spill",
    )
    with pytest.raises(StorageError) as ei:
        for _ in range(100):
            st.append(0, b"x" * 4096)
        st.flush()
    assert ei.value.errno == 28 and ei.value.path == "s3://bucket/f.spill"
    assert isinstance(ei.value, OSError)
    with pytest.raises(StorageError):
        st.append(0, b"y")
    with pytest.raises(StorageError):
        st.finish(False)


def test_local_disk_full_is_a_storage_error(tmp_path: Path) -> None:
    """A real write failure from the OS (file size limit) keeps its errno."""
    import subprocess
    import sys

    code = f"""
import resource, signal, errno, spillover
from spillover.errors import StorageError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
st = spillover.open_storage({str(tmp_path)!r}).create_storer(0)
try:
    for _ in range(100):
        st.append(0, b"x" * 65536)
    st.close()
except StorageError as e:
    assert e.errno == errno.EFBIG, e.errno
    assert e.path.endswith("in-00000.spill")
    print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


# --- the retriever's contract ------------------------------------------------------------


def test_poll_next_streams_and_says_when_more_is_ready(tmp_path: Path) -> None:
    frames = [(i % 4, 0, os.urandom(3000)) for i in range(200)]
    handle = write_native(tmp_path, frames)
    r = spillover.open_retriever(handle, read_block_bytes=8192, read_ahead_bytes=16384)
    got = []
    deadline = time.monotonic() + 30
    while not r.finished:
        b = r.poll_next()
        if b is None:
            assert r.wait(timeout=5) or r.finished
        else:
            got.append((b.channel_id, b.data_type, bytes(b)))
        assert time.monotonic() < deadline
    assert got == frames
    assert r.poll_next() is None and r.finished
    r.close()


def test_retrieved_buffers_stay_valid_while_held(tmp_path: Path) -> None:
    """Blocks are reused only once no buffer points into them: held buffers never change."""
    frames = [(0, 0, os.urandom(1000)) for _ in range(300)]
    handle = write_native(tmp_path, frames)
    with spillover.open_retriever(handle, read_block_bytes=4096, read_ahead_bytes=8192) as r:
        held = list(r)
        assert [bytes(b) for b in held] == [p for _, _, p in frames]
        views = [memoryview(b) for b in held]
        assert all(v.readonly for v in views)
        arr = np.frombuffer(held[0], dtype=np.uint8)
        assert arr.tobytes() == frames[0][2]


@pytest.mark.parametrize("reader", ["native", "arrow"])
def test_retrieval_memory_is_bounded(tmp_path: Path, reader: str) -> None:
    """Streaming a file 10x the read-ahead window grows peak RSS by less than 2 windows."""
    import subprocess
    import sys

    frames = [(i % 8, 0, os.urandom(32768)) for i in range(1280)]  # 40 MiB
    handle = write_native(tmp_path, frames)
    code = f"""
import spillover, pyarrow.fs as pafs
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
kw = {{"filesystem": pafs.LocalFileSystem()}} if {reader!r} == "arrow" else {{}}
open("/proc/self/clear_refs", "w").write("5")
before = rss("VmRSS:")
n = 0
with spillover.open_retriever({handle.uri!r}, read_ahead_bytes=4 << 20, **kw) as r:
    for b in r:
        n += len(b)
assert n == 40 << 20
print(rss("VmHWM:") - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout)
    assert growth < 2 * (4 << 20), f"peak RSS grew by {growth} bytes"


def test_large_buffer_spans_many_read_blocks(tmp_path: Path) -> None:
    big = os.urandom(3 * 1024 * 1024 + 7)
    handle = write_native(tmp_path, [(0, 0, b"a"), (1, 1, big), (0, 0, b"b")])
    with spillover.open_retriever(handle, read_block_bytes=65536, read_ahead_bytes=131072) as r:
        assert [(b.channel_id, b.data_type, bytes(b)) for b in r] == [
            (0, 0, b"a"),
            (1, 1, big),
            (0, 0, b"b"),
        ]


def test_closing_a_retriever_midway_stops_the_reader(tmp_path: Path) -> None:
    handle = write_native(tmp_path, [(0, 0, os.urandom(4096)) for _ in range(1000)])
    before = threading.active_count()
    r = spillover.open_retriever(handle, read_block_bytes=8192, read_ahead_bytes=16384)
    assert r.wait(5)
    assert r.poll_next() is not None
    r.close()
    assert threading.active_count() == before
    with pytest.raises(ClosedError):
        r.poll_next()


def test_handle_round_trips_through_json(tmp_path: Path) -> None:
    import json

    handle = write_native(tmp_path, [(3, 0, b"abc"), (9, 1, b"")], "lz4")
    again = spillover.GateStateHandle.from_dict(json.loads(json.dumps(handle.to_dict())))
    assert again == handle
    with spillover.open_retriever(again) as r:
        assert [bytes(b) for b in r] == [b"abc", b""]


def test_bad_options_fail_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        spillover.open_storage(tmp_path, compression="zstd")
    with pytest.raises(ConfigError):
        spillover.open_storage(tmp_path, batch_size=3)
    with pytest.raises(ConfigError):
        spillover.open_storage(tmp_path, read_ahead_bytes=4096, read_block_bytes=65536)


@pytest.mark.s3
def test_unreachable_s3_is_a_storage_error(tmp_path: Path) -> None:
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(
        endpoint_override="127.0.0.1:1",
        scheme="http",
        access_key="a",
        secret_key="b",
        connect_timeout=0.5,
        request_timeout=0.5,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
    )
    storage = spillover.open_storage("bucket/dir", filesystem=fs)
    with pytest.raises(StorageError) as ei:
        storage.create_storer(0)
    assert "reachable" in (ei.value.hint or "")
