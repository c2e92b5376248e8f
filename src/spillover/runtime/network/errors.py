"""Errors of the network, and the fresh per-waiter copies threads raise."""

from __future__ import annotations

import time

from spillover.errors import SpilloverError


class NetworkError(SpilloverError, RuntimeError):
    """A partition or gate was used in a way its wiring does not allow."""


class ChannelFailedError(NetworkError):
    """The other end of a channel failed; the original error is the ``__cause__``."""


class ChannelCancelledError(ChannelFailedError):
    """A partition or gate was cancelled while a producer or consumer used it."""


def failure(where: str, cause: BaseException) -> ChannelFailedError:
    """A fresh error for one waiter (exceptions are not shared between threads)."""
    if isinstance(cause, ChannelCancelledError):
        return ChannelCancelledError(f"{where} was cancelled")
    err = ChannelFailedError(f"{where} failed", detail=f"{type(cause).__name__}: {cause}")
    err.__cause__ = cause
    return err


def deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout
