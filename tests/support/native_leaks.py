"""With ``SPILLOVER_CHECK_LEAKS=1`` (a debug build, ``make debug-test``), the run
fails unless every native handle (writers, readers, read-ahead blocks, buffer pools)
was freed by its end: the extensions count them in ``live_handles()``."""

from __future__ import annotations

import gc
import os

import pytest

from spillover._native import _records, _storage


def _live() -> dict[str, int]:
    gc.collect()
    return {"_storage": _storage.live_handles(), "_records": _records.live_handles()}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("SPILLOVER_CHECK_LEAKS") != "1":
        return
    live = _live()
    if any(n < 0 for n in live.values()):
        session.config.get_terminal_writer().line(
            "SPILLOVER_CHECK_LEAKS=1 needs a debug build (SPILLOVER_DEBUG=1): nothing counted"
        )
        session.exitstatus = pytest.ExitCode.USAGE_ERROR
        return
    leaked = {k: n for k, n in live.items() if n}
    if leaked:
        session.config.get_terminal_writer().line(f"native handles not freed: {leaked}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        session.config.get_terminal_writer().line("native handles: every one freed", green=True)
