"""Fuzz target: the job lease file's parser (``Lease.from_bytes``).

Every input either parses or is refused with a ``SpilloverError`` (a ``LeaseError``,
or ``UnsupportedVersionError`` for a newer version). A lease that parses has a holder
and times of the right types, and what a master asks of a lease it found (is it
live, is its holder a process of this host that is gone) has an answer: the holder
is asked as if it named this host, so that its pid is looked up.

    python fuzz/fuzz_lease.py [libFuzzer flags] [corpus directories]
"""

from __future__ import annotations

import dataclasses
import socket

from _fuzzing import FUZZ_DIR, instrumented, main

with instrumented(__name__):
    import _harness as h
    from spillover.errors import SpilloverError
    from spillover.runtime.jobevents.lease import Lease

DEFAULTS = {"-max_len": "2048", "-timeout": "30", "-dict": str(FUZZ_DIR / "dicts" / "json.dict")}


def TestOneInput(data: bytes) -> None:
    lease = h.outcome(Lease.from_bytes, data, "_lease")
    if isinstance(lease, SpilloverError):
        return
    holder = lease.holder
    if not (
        isinstance(holder.host, str)
        and isinstance(holder.pid, int)
        and isinstance(holder.token, str)
        and isinstance(lease.acquired_at, float)
        and isinstance(lease.expires_at, float)
    ):
        raise h.OracleError(f"a lease parsed into the wrong types: {lease!r}")
    lease.live(0.0)
    dataclasses.replace(holder, host=socket.gethostname()).gone()


if __name__ == "__main__":
    main(TestOneInput, DEFAULTS)
