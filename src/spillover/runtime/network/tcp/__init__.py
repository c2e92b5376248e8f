"""TCP transport: a subpartition of one worker feeds an input channel of another.

The producer's end is a :class:`TcpSubpartition` (a :class:`Subpartition`, attached
with :func:`connect_tcp`); the consumer's end is a :class:`TcpReceiver`, one per
worker, which serves the input gates registered with it. One TCP connection
carries one channel; docs/network.md ("TCP transport") has the wire format.

Semantics are those of :class:`~spillover.runtime.network.local.LocalChannel`: FIFO
data, credit-based flow control, events without credit, a priority path,
EndOfPartition last, failures reaching both ends. Two differences:

- Credit: a remote channel announces only its exclusive credits
  (``buffers_per_channel``), never the gate's floating ones, so the receiving
  thread never has to wait in ``push_data`` (floating credit is shared with other
  channels and could be gone by the time the buffer arrives).
- Priority events split the overtaken data in two. ``add_event(priority=True)``
  returns the data buffers still in the producer's send queue (the producer
  persists them as output state; they follow the event on the wire). Data the
  sender thread already handed to the socket reaches the consumer ahead of the
  event; what of it the consumer has not polled yet is overtaken there, and the
  receiver hands those buffers to the gate's ``on_overtaken`` handler (the
  consumer persists them as input state of that channel).

Buffers travel without copies in Python: ``socket.sendmsg`` of the buffers'
memoryviews on the producer, ``recv_into`` pooled segments on the consumer.
"""

from spillover.runtime.network.tcp.protocol import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    ErrorCode,
    FrameType,
    HandshakeError,
    OvertakenHandler,
    ProtocolError,
    RemoteError,
    TransportError,
)
from spillover.runtime.network.tcp.receiver import TcpReceiver
from spillover.runtime.network.tcp.sender import TcpSubpartition, connect_tcp

__all__ = [
    "HEADER",
    "MAGIC",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "FrameType",
    "HandshakeError",
    "OvertakenHandler",
    "ProtocolError",
    "RemoteError",
    "TcpReceiver",
    "TcpSubpartition",
    "TransportError",
    "connect_tcp",
]
