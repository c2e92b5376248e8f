"""Channels between subtasks: result partitions, input gates and credit-based flow control.

A producer writes buffers into a :class:`ResultPartition`, one subpartition per
consumer subtask; each subpartition is linked to one :class:`InputChannel` of a
consumer's :class:`InputGate`. A data buffer enters a channel only when the
channel has credit (room for one more buffer), so a consumer that stops polling
stalls its producers. Events need no credit; priority events (unaligned
barriers) go ahead of the buffers already queued.

Transports plug in behind :class:`Subpartition` (the producer's end of a channel)
and :class:`CreditListener` (told when the consumer frees credit).
:class:`LocalChannel` links a subpartition to an input channel of the same
process in memory; docs/network.md says how a TCP transport fits the same shape.

Buffer ownership: a buffer handed to ``emit``/``broadcast`` belongs to the
partition from then on (unless the call raises: then the caller keeps it). A
buffer returned by ``InputGate.poll`` belongs to the caller, who releases it once
done with it (after processing or persisting it); that release returns the
channel's credit.
"""

from spillover.runtime.network.errors import (
    ChannelCancelledError,
    ChannelFailedError,
    NetworkError,
)
from spillover.runtime.network.gate import InputChannel, InputGate
from spillover.runtime.network.local import LocalChannel, connect, wire
from spillover.runtime.network.partition import CreditListener, ResultPartition, Subpartition

__all__ = [
    "ChannelCancelledError",
    "ChannelFailedError",
    "CreditListener",
    "InputChannel",
    "InputGate",
    "LocalChannel",
    "NetworkError",
    "ResultPartition",
    "Subpartition",
    "connect",
    "wire",
]
