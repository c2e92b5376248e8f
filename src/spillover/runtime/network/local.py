"""Channels within one process: :class:`LocalChannel` links a subpartition to an
input channel in memory; :func:`connect` and :func:`wire` build the links."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from spillover.errors import ConfigError
from spillover.runtime.api import EdgeKind
from spillover.runtime.network.buffers import NetworkBuffer
from spillover.runtime.network.errors import (
    NetworkError,
)
from spillover.runtime.network.gate import InputChannel, InputGate
from spillover.runtime.network.partition import ResultPartition, Subpartition
from spillover.storage import DataType

_DATA = DataType.DATA


class LocalChannel(Subpartition):
    """Links a subpartition to an input channel in the same process: buffers are
    handed over by reference, the producer waits on the gate's credit directly."""

    def __init__(self, channel: InputChannel) -> None:
        self.channel = channel

    def add_data(self, buffer: NetworkBuffer, deadline: float | None) -> float:
        return self.channel.push_data(buffer, deadline)

    def add_event(self, buffer: NetworkBuffer, priority: bool) -> list[NetworkBuffer]:
        return self.channel.push_event(buffer, priority)

    def finish(self, buffer: NetworkBuffer) -> None:
        self.channel.push_end(buffer)

    def fail(self, cause: BaseException) -> None:
        self.channel.fail(cause)

    @property
    def credit(self) -> int:
        return self.channel.credit

    @property
    def backlog(self) -> tuple[int, int]:
        return self.channel.queued_buffers, self.channel.queued_bytes


def connect(
    partition: ResultPartition, subpartition: int, gate: InputGate, channel: int
) -> LocalChannel:
    """Links ``partition``'s subpartition to ``gate``'s channel in memory."""
    ch = gate.channel(channel)
    if ch.connected:
        raise NetworkError(f"{ch.where} is already connected")
    link = LocalChannel(ch)
    partition.connect(subpartition, link)
    ch.on_credit = partition.credit_returned
    ch.on_buffer_size = functools.partial(partition.announce_buffer_size, subpartition)
    ch.connected = True
    return link


def wire(
    partitions: Sequence[ResultPartition],
    gates: Sequence[InputGate],
    pattern: str | EdgeKind,
) -> None:
    """Connects the producers' partitions to the consumers' gates of one edge, in memory.

    ``"forward"`` (``EdgeKind.FORWARD``): partition ``i`` (one subpartition) feeds
    gate ``i`` (one channel). ``"all_to_all"`` (the other edge kinds): subpartition
    ``j`` of partition ``i`` feeds channel ``i`` of gate ``j``.
    """
    if isinstance(pattern, EdgeKind):
        pattern = "forward" if pattern is EdgeKind.FORWARD else "all_to_all"
    if pattern == "forward":
        if (
            len(partitions) != len(gates)
            or any(p.num_subpartitions != 1 for p in partitions)
            or any(g.num_channels != 1 for g in gates)
        ):
            raise ConfigError(
                "a forward edge needs as many producers as consumers, one channel each"
            )
        for p, g in zip(partitions, gates, strict=True):
            connect(p, 0, g, 0)
    elif pattern == "all_to_all":
        if any(p.num_subpartitions != len(gates) for p in partitions) or any(
            g.num_channels != len(partitions) for g in gates
        ):
            raise ConfigError(
                "an all-to-all edge needs one subpartition per consumer and one "
                "channel per producer"
            )
        for i, p in enumerate(partitions):
            for j, g in enumerate(gates):
                connect(p, j, g, i)
    else:
        raise ConfigError(f"unknown wiring pattern {pattern!r}", hint="forward or all_to_all")
