"""Loop tasks pass each termination round's probe on (``termination.py``).

A task in a loop body forwards ``LoopProbe(r)`` on its loop outputs once the probe
came on every live channel from inside the loop. It does not block a channel
whose probe came: records behind it may then overtake the probe downstream,
which only makes a round look busier than it was (never quieter), so the
protocol stays safe and no task waits for another.
"""

from __future__ import annotations

from collections.abc import Callable


class ProbeRelay:
    """A loop body task's probes: passed on once per round, in round order, through
    ``send(round)`` (``LoopProbe(round)`` in line on the loop's outputs)."""

    def __init__(self, channels: frozenset[int], send: Callable[[int], None]) -> None:
        self.channels = set(channels)
        self.send = send
        self.arrived: dict[int, set[int]] = {}

    def on_probe(self, ch: int, round: int) -> None:
        self.arrived.setdefault(round, set()).add(ch)
        self._pass()

    def channel_ended(self, ch: int) -> None:
        """An ended channel brings no more probes."""
        self.channels.discard(ch)
        self._pass()

    def _pass(self) -> None:
        for r in sorted(self.arrived):
            if not self.channels <= self.arrived[r]:
                return
            del self.arrived[r]
            self.send(r)
