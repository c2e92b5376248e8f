"""The exceptions spillover raises.

Every error is a :class:`SpilloverError` and also the builtin exception a caller
would catch without knowing spillover (``ValueError`` for bad data, ``OSError``
for storage trouble, ...). Errors about a file carry ``path`` and ``offset``;
``detail`` says what was found and ``hint`` what to do. Tell errors apart by
class, never by message text.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadMagicError",
    "BatchTypeError",
    "ClosedError",
    "ConfigError",
    "CorruptFrameError",
    "CorruptHeaderError",
    "CorruptIndexError",
    "CorruptRecordError",
    "ForeignFileError",
    "FormatError",
    "KeyGroupRangeError",
    "RescaleError",
    "SpilloverError",
    "StateFileExistsError",
    "StateFileNotFoundError",
    "StorageError",
    "TruncatedFileError",
    "UnsupportedVersionError",
]


class SpilloverError(Exception):
    """Base of every spillover error."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        offset: int | None = None,
        detail: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.path = path
        self.offset = offset
        self.detail = detail
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        text = self.message
        if self.path is not None:
            text += f" [file {self.path}"
            text += f" at offset {self.offset}]" if self.offset is not None else "]"
        if self.detail:
            text += f": {self.detail}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text

    def __str__(self) -> str:
        return self._render()

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (
            type(self),
            self.message,
            {"path": self.path, "offset": self.offset, "detail": self.detail, "hint": self.hint},
        )


def _rebuild(cls: type[SpilloverError], message: str, kw: dict[str, object]) -> SpilloverError:
    return cls(message, **kw)  # type: ignore[arg-type]


class ConfigError(SpilloverError, ValueError):
    """An option has a bad value, or two options do not go together."""


class ClosedError(SpilloverError, RuntimeError):
    """A storer, retriever or storage was used after ``close()``."""


class FormatError(SpilloverError, ValueError):
    """A state file is not a valid format-v1 file."""


class BadMagicError(FormatError):
    """The file does not start with spillover's magic: it is not a state file."""


class UnsupportedVersionError(FormatError):
    """The file was written in a format version this reader does not know."""


class CorruptHeaderError(FormatError):
    """The state header, a frame header or the trailer fails its checksum or sanity checks."""


class CorruptFrameError(FormatError):
    """A frame's payload does not match its checksum, or does not decode."""


class CorruptIndexError(FormatError):
    """A channel index entry (docs/format.md, "Channel index") is truncated, fails its
    checksum or its sanity checks, or does not match the gate that names it."""


class ForeignFileError(FormatError):
    """The file is a valid state file, but not the one the state handle names."""


class TruncatedFileError(FormatError, EOFError):
    """The file ends early: it was never closed cleanly, or it was cut."""


class StorageError(SpilloverError, OSError):
    """The storage failed or could not be reached; ``errno`` is kept when known."""

    def __init__(self, message: str, *, errno: int | None = None, **kw: object) -> None:
        super().__init__(message, **kw)  # type: ignore[arg-type]
        self.errno = errno

    def __reduce__(self) -> tuple[Any, ...]:
        cls, (kind, message, kw) = super().__reduce__()
        return cls, (kind, message, {**kw, "errno": self.errno})


class StateFileNotFoundError(StorageError, FileNotFoundError):
    """A state file the caller asked for does not exist."""


class StateFileExistsError(StorageError, FileExistsError):
    """A storer would overwrite an existing state file."""


class RescaleError(SpilloverError, ValueError):
    """In-flight channel state cannot be mapped onto the new parallelism as asked."""


class CorruptRecordError(FormatError):
    """Records in a buffer do not parse: a bad length prefix, a record too short for its key."""


class BatchTypeError(SpilloverError, TypeError):
    """A user function returned something other than a batch of the declared dtype
    (or a filter mask that is not one boolean per record)."""


class KeyGroupRangeError(SpilloverError, ValueError):
    """Keyed state got a key whose key group lies outside the subtask's range (a routing bug)."""


class JobNotFoundError(ConfigError):
    """No registered job has the id given (``spillover savepoint|stop|cancel ...``)."""


class JobNotRunningError(ConfigError):
    """The job asked to take a savepoint, stop, cancel or rescale has ended already."""
