"""Where a task's chain sends its batches and in-line events: the next chained
operator, or the network (every outgoing edge's writer and outbox)."""

from __future__ import annotations

from spillover.runtime.api import Batch, Operator
from spillover.runtime.network import events as ev
from spillover.runtime.network.writers import Outbox, PartitionWriter


class ChainOutput:
    """Output of a chained operator: the next operator's input."""

    def __init__(self, op: Operator) -> None:
        self.op = op

    def emit(self, batch: Batch) -> None:
        if len(batch):
            self.op.process(batch, 0)

    def emit_watermark(self, timestamp_ms: int) -> None:
        self.op.process_watermark(timestamp_ms)


class NetworkOutput:
    """Output of a chain's tail: every outgoing edge's writer, and its outbox for the
    events that travel in line (watermarks, watermark statuses)."""

    def __init__(self, writers: list[PartitionWriter], outboxes: list[Outbox]) -> None:
        self.writers = writers
        self.outboxes = outboxes
        self.records = 0
        self.idle = False  # the watermark status last sent

    def emit(self, batch: Batch) -> None:
        if len(batch):
            self.records += len(batch)
            for w in self.writers:
                w.emit(batch)

    def _send(self, event: ev.Watermark | ev.WatermarkStatus) -> None:
        # Partly filled buffers go first: the event follows whole records.
        for w in self.writers:
            w.flush()
        for box in self.outboxes:
            box.send_event(event)

    def emit_watermark(self, timestamp_ms: int) -> None:
        self._send(ev.Watermark(timestamp_ms))

    def emit_status(self, idle: bool) -> None:
        if idle != self.idle:
            self.idle = idle
            self._send(ev.WatermarkStatus(idle))
