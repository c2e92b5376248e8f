"""A producer's result partition linked to a consumer's input gate over one channel
implementation (in memory or TCP on loopback), for the subpartition contract."""

from __future__ import annotations

from dataclasses import dataclass, field

from spillover.runtime.network.buffers import BufferPool, NetworkBuffer
from spillover.runtime.network.events import Event, deserialize
from spillover.runtime.network.gate import InputGate
from spillover.runtime.network.local import connect
from spillover.runtime.network.partition import ResultPartition
from spillover.runtime.network.tcp import TcpReceiver, TcpSubpartition, connect_tcp
from support.threads import JOIN, eventually, transport_threads

SECRET = b"subpartition contract secret"
SEGMENT = 64  # bytes per network buffer: the largest payload a channel carries


def item(buf: NetworkBuffer) -> bytes | Event:
    """What a polled buffer carries: its bytes, or its event."""
    return deserialize(buf) if buf.is_event else bytes(buf)


@dataclass
class Link:
    """``partition``'s subpartition ``i`` feeds ``gate``'s channel ``i``.

    Priority events overtake data where it waits: in memory all of it on the
    channel (``broadcast_event`` returns it); over TCP what is still in the send
    queue is returned there and what already reached the consumer is handed to the
    gate's overtaken handler, kept per channel in ``consumer_overtaken``.
    """

    kind: str
    partition: ResultPartition
    gate: InputGate
    exclusive: int
    consumer_overtaken: dict[int, list[bytes]] = field(default_factory=dict)
    subs: list[TcpSubpartition] = field(default_factory=list)

    def close(self) -> bool:
        """Ends the producer's side (over TCP: waits until the stream was written
        and the consumer closed); True when every channel's stream completed, its
        EndOfPartition taken by the consumer."""
        written = all([s.close(JOIN) for s in self.subs])
        ended = all(self.gate.channel(i).finished for i in range(self.gate.num_channels))
        return written and ended


class Links:
    """Builds links of one kind and closes them all at the end of a test."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.links: list[Link] = []
        self.receiver: TcpReceiver | None = None
        self._names = 0
        self._threads_before = transport_threads()

    def __call__(self, subpartitions: int = 1, exclusive: int = 2) -> Link:
        """A new link with ``exclusive`` credits per channel and no floating ones
        (TCP announces only exclusive credit), so both kinds stall alike."""
        self._names += 1
        name = f"g{self._names}"
        part = ResultPartition(subpartitions, BufferPool(SEGMENT, 64), f"p-{name}")
        gate = InputGate(
            subpartitions, floating_buffers=0, buffers_per_channel=exclusive, name=name
        )
        link = Link(self.kind, part, gate, exclusive)
        if self.kind == "local":
            for i in range(subpartitions):
                connect(part, i, gate, i)
        else:
            if self.receiver is None:
                self.receiver = TcpReceiver(SECRET, "127.0.0.1", 0, poll_interval=0.05)

            def persist(channel: int, event: Event, bufs: list[NetworkBuffer]) -> None:
                link.consumer_overtaken.setdefault(channel, []).extend(bytes(b) for b in bufs)
                for b in bufs:
                    b.release()

            self.receiver.register(gate, on_overtaken=persist)
            link.subs = [
                connect_tcp(part, i, self.receiver.address, name, i, SECRET, poll_interval=0.05)
                for i in range(subpartitions)
            ]
        self.links.append(link)
        return link

    def close(self) -> None:
        """Closes every link and the receiver; every transport thread they started
        ends."""
        for link in self.links:
            link.close()
        if self.receiver is not None:
            self.receiver.close()
        eventually(lambda: not transport_threads() - self._threads_before)
