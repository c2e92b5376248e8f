"""The durable steps of a publish as the system sees them: a snippet of Python run
under strace, its fsyncs, renames and links in the order they happened."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def durable_steps(code: str, trace: Path, names: set[str]) -> list[str]:
    """Runs ``code`` in a fresh interpreter under strace; returns ``fsync <path>`` for
    every successful fsync (the path its descriptor was opened on) and ``rename
    <dst>`` or ``link <dst>`` for each one giving a name in ``names``, in order.
    Skips the test where strace cannot trace (a container that forbids ptrace)."""
    traced = ("strace", "-f", "-e", "trace=openat,fsync,rename,link", "-o", str(trace))
    done = subprocess.run(
        [*traced, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    if done.returncode != 0 and any(ln.startswith("strace:") for ln in done.stderr.splitlines()):
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    fds: dict[str, str] = {}  # descriptor -> the path it was opened on
    order: list[str] = []
    for line in trace.read_text().splitlines():
        if m := re.search(r'openat\(AT_FDCWD, "([^"]+)".*= (\d+)$', line):
            fds[m.group(2)] = m.group(1)
        elif m := re.search(r"fsync\((\d+)\)\s+= 0", line):
            order.append("fsync " + fds.get(m.group(1), "?"))
        elif (m := re.search(r'(rename|link)\("([^"]+)", "([^"]+)"\)\s+= 0', line)) and m.group(
            3
        ) in names:
            order.append(f"{m.group(1)} {m.group(3)}")
    return order
