"""Loop tasks pass each termination round's probe on (``termination.py``).

A task in a loop body forwards ``LoopProbe(r)`` on its loop outputs once the probe
came on every live channel from inside the loop. It does not block a channel
whose probe came: records behind it may then overtake the probe downstream,
which only makes a round look busier than it was (never quieter), so the
protocol stays safe and no task waits for another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spillover.runtime.network import events as ev

if TYPE_CHECKING:
    from spillover.runtime.task import Task


def loop_channels(task: Task) -> frozenset[int]:
    """The task's input channels that come from inside its loop."""
    g, loop = task.graph, task.vertex.loop
    return frozenset(
        ch for ch, c in enumerate(task.channels) if g.vertices[c.edge.source].loop == loop
    )


def loop_outputs(task: Task) -> list[int]:
    """The task's outputs (partition indexes) that lead into its loop."""
    g, loop = task.graph, task.vertex.loop
    return [
        i for i, e in enumerate(g.outputs_of(task.vertex.id)) if g.vertices[e.target].loop == loop
    ]


def send_probe(task: Task, outputs: list[int], round: int) -> None:
    """``LoopProbe(round)`` in line behind everything ``task`` emitted on ``outputs``."""
    probe = ev.LoopProbe(round)
    for i in outputs:
        task.writers[i].flush()  # partly filled buffers first: the probe follows them
        task.outboxes[i].send_event(probe)


class ProbeRelay:
    """A loop body task's probes: passed on once per round, in round order."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.channels = set(loop_channels(task))
        self.outputs = loop_outputs(task)
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
            send_probe(self.task, self.outputs, r)
