"""Type stubs of the native storage core (see _storage.pyx)."""

from collections.abc import Callable
from typing import Any

from spillover.errors import SpilloverError

FORMAT_VERSION: int
HEADER_SIZE: int
FRAME_HEADER_SIZE: int
TRAILER_SIZE: int
MAX_PAYLOAD: int

def crc32c(data: Any, value: int = 0) -> int: ...
def crc32c_hardware() -> bool: ...
def error_for(
    code: int,
    path: str | None,
    offset: int | None,
    detail: str | None = None,
    errno: int = 0,
    message: str | None = None,
) -> SpilloverError: ...
def encode_state_header(
    checkpoint_id: int,
    subtask_index: int,
    gate_id: int,
    gate_kind: int,
    codec: int,
    file_id: bytes,
) -> bytes: ...
def decode_state_header(data: Any, path: str | None = None) -> dict[str, Any]: ...
def encode_trailer(
    frame_count: int, raw_bytes: int, stored_bytes: int, file_id: bytes
) -> bytes: ...
def decode_trailer(
    data: Any, path: str | None = None, offset: int | None = None
) -> dict[str, Any]: ...
def writer_pool_stats() -> tuple[int, int]: ...

class NativeStorer:
    path: str
    frames: int
    raw_bytes: int
    stored_bytes: int
    channels: dict[int, list[int]]
    channel_ranges: dict[int, list[int]]
    bytes_written: int
    staged: bool
    """Its file is a local staging file: its trailer may be written with the GIL kept."""
    def __init__(
        self,
        fd: int,
        sink_write: Callable[[Any], Any] | None,
        header: bytes,
        file_id: bytes,
        compress: Callable[..., bytes] | None,
        batch_bytes: int,
        pool_bytes: int,
        path: str,
    ) -> None: ...
    def append(self, channel_id: int, buffer: Any, data_type: int = 0) -> None: ...
    def set_bound(self, bound: int, on_bound: Callable[[], object] | None) -> None:
        """Drains and calls ``on_bound()`` once before the stored bytes pass ``bound``."""
    def submit(self) -> None: ...
    def reap(self) -> None: ...
    def flush(self) -> None: ...
    def finish(self, fsync: bool) -> int: ...
    def discard(self) -> None: ...

class OnRelease:
    """Exports ``obj``'s bytes read-only; calls ``callback`` when the last view goes."""

    def __init__(self, obj: Any, callback: Callable[[], object]) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...

class Block:
    @property
    def capacity(self) -> int: ...
    @property
    def users(self) -> int: ...
    def __init__(self, capacity: int) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def move_tail(self, dst: Block, start: int, end: int) -> None: ...

class RetrievedBuffer:
    """One buffer read back from a state file; read-only, zero-copy (buffer protocol)."""

    channel_id: int
    data_type: int
    offset: int
    codec: int
    stored_length: int
    more_available: bool
    @property
    def is_event(self) -> bool: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...
    def tobytes(self) -> bytes: ...

class FrameBatch:
    @property
    def remaining(self) -> int: ...
    def next(self) -> RetrievedBuffer | None: ...
    def __iter__(self) -> FrameBatch: ...
    def __next__(self) -> RetrievedBuffer: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    @property
    def base_offset(self) -> int: ...
    def take_all(self) -> tuple[Any, Any, Any, Any, Any, Any]: ...

class NativeReader:
    def __init__(
        self,
        fd: int,
        start: int,
        end: int,
        block_bytes: int,
        max_queued: int,
        frames: int,
        raw_bytes: int,
        stored_bytes: int,
        verify: bool,
        decompress: Callable[..., bytes] | None,
        path: str,
        whole: bool = True,
    ) -> None: ...
    def next_batch(self, timeout: float) -> FrameBatch | bool | None: ...
    def close(self) -> None: ...

def scan_block(
    block: Block,
    length: int,
    base: int,
    verify: bool,
    decompress: Callable[..., bytes] | None,
    path: str,
) -> tuple[FrameBatch, int, int, int, int, int]: ...

SECTION_CREATE: int
SECTION_FSYNC: int
SECTION_EMPTY: int
PUBLISH_REPLACE: int

def append_sections(
    sections: list[tuple[int, int, int, bool, bytes]],
    path: str,
    flags: int,
    keep_gil: bool = False,
) -> tuple[int, str, bool, list[bool]]:
    """A part's sections, ``(fd, bytes, offset, in memory, entry)`` each, in one call
    (one open, one fsync): ``(errno, step, opened, emptied per section)``."""

def copy_range(src: int, dst: int, count: int, at: int, in_memory: bool) -> int:
    """``count`` bytes from offset 0 of ``src`` to offset ``at`` of ``dst``: errno or 0."""

def write_new_file(path: str, data: Any, flags: int) -> tuple[int, str]:
    """Writes ``data`` as a new file at ``path`` in one call: ``(errno, step)``."""

def publish_file(tmp: str, path: str, data: Any, flags: int) -> tuple[int, str]:
    """Publishes ``data`` as ``path`` through the new file ``tmp``: ``(errno, step)``."""

PUBLISH_MAX: int

def publish_files(files: list[tuple[str, str, Any, int]]) -> tuple[int, int, str]:
    """Publishes ``(tmp, path, data, flags)`` files in order: ``(errno, index, step)``."""

def raw_write_baseline(fd: int, buffers: list[Any], batch_bytes: int) -> int: ...
def raw_read_baseline(fd: int, block: Block) -> int: ...
def live_handles() -> int:
    """Native handles of this extension alive now; -1 when not a debug build."""

# sockio.pxi
SOCK_DONE: int
SOCK_TIMEOUT: int
SOCK_EOF: int
SOCK_ERROR: int

def sock_read_frame(
    fd: int,
    buf: bytearray | memoryview,
    got: int,
    header: int,
    length_at: int,
    whole_type_skip: int,
    timeout: float,
) -> tuple[int, int, int]: ...
def sock_read_into(
    fd: int, dst: bytearray | memoryview, got: int, ahead: bytearray | memoryview, timeout: float
) -> tuple[int, int, int, int]: ...
def sock_send_now(fd: int, head: bytes | memoryview, body: bytes | memoryview) -> int: ...
def sock_recv(
    fd: int, buf: bytearray | memoryview, start: int, timeout: float
) -> tuple[int, int, int]: ...

SOCK_FRAME: int

class Wake:
    """An auto-reset wake-up, posted from any thread (natively without the GIL)."""

    def post(self) -> None: ...
    def arm(self) -> None: ...
    def disarm(self) -> None: ...
    def notify_armed(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    @property
    def wakes(self) -> int: ...

class Credit:
    """A producer's credit on one channel, lock-free."""

    def __init__(self, initial: int = 0) -> None: ...
    def add(self, delta: int) -> None: ...
    def take(self) -> bool: ...
    @property
    def value(self) -> int: ...
    @property
    def granted(self) -> int: ...

def sock_read_credit(
    fd: int,
    buf: bytearray | memoryview,
    start: int,
    end: int,
    credit_type: int,
    channel: int,
    credit: Credit,
    credit_wake: Wake,
    output_wake: Wake | None,
    timeout: float,
) -> tuple[int, int, int, int]: ...
