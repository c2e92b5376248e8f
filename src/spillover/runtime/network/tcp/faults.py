"""A test hook that breaks a worker's connections on purpose: a data channel's TCP
connection or its control connection to the job master, reset or stalled after it
sent a given number of frames (data buffers, or control messages).

A :class:`NetworkFault` is a value shipped to every worker of a job (the way a
:class:`~spillover.runtime.failures.FailureInjector` script is); the worker it
names, in the generation it names, arms a :class:`FaultCounter` that its
connections of that kind consult per frame sent. The fault strikes once, on the
connection whose frame reached the count:

- ``reset``: the connection is cut at once (a reset socket, no ERROR frame): both
  ends fail, as when a peer dies or a network path drops;
- ``stall``: the connection stays open but the worker sends nothing more on it,
  heartbeats included, as when a peer hangs or a path blackholes. Only the other
  end's heartbeat timeout (``heartbeat.timeout``) can tell; it turns the silence
  into a failure.

Either way the attempt fails and the job restarts from its latest checkpoint.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from spillover.errors import ConfigError

__all__ = ["CONNECTIONS", "FAULT_ACTIONS", "FaultCounter", "NetworkFault"]

CONNECTIONS = ("data", "control")
FAULT_ACTIONS = ("reset", "stall")


@dataclass(frozen=True)
class NetworkFault:
    """Worker ``worker`` of generation ``generation`` resets or stalls (``action``)
    the ``connection`` (``data``: its TCP channels to other workers; ``control``:
    its connection to the job master) whose send is its ``after``-th frame of that
    kind (counted over all its channels)."""

    connection: str
    action: str
    after: int = 100
    worker: int = 0
    generation: int = 0

    def __post_init__(self) -> None:
        if self.connection not in CONNECTIONS or self.action not in FAULT_ACTIONS:
            raise ConfigError(
                f"no network fault {self.connection!r} {self.action!r}",
                hint=f"a connection of {CONNECTIONS} and an action of {FAULT_ACTIONS}",
            )
        if self.after < 1 or self.worker < 0 or self.generation < 0:
            raise ConfigError(
                "a network fault strikes after at least one frame, on a worker and "
                "generation counted from 0",
                detail=f"after={self.after}, worker={self.worker}, generation={self.generation}",
            )

    @classmethod
    def parse(cls, text: str) -> NetworkFault:
        """From ``CONNECTION:ACTION[:after=N][:worker=W][:generation=G]``, e.g.
        ``data:stall:after=200:worker=1``."""
        parts = text.strip().split(":")
        if len(parts) < 2:
            raise ConfigError(
                f"bad network fault {text!r}", hint="CONNECTION:ACTION[:after=N][:worker=W]"
            )
        numbers: dict[str, int] = {}
        for part in parts[2:]:
            key, _, value = part.partition("=")
            if key not in ("after", "worker", "generation") or not value.isdigit():
                raise ConfigError(
                    f"bad network fault {text!r}", detail=f"at {part!r}", hint="after=N, worker=W"
                )
            numbers[key] = int(value)
        return cls(parts[0], parts[1], **numbers)

    def describe(self) -> str:
        return f"{self.connection} {self.action} after {self.after} frames on worker {self.worker}"

    def counter(self, connection: str, worker: int, generation: int) -> FaultCounter | None:
        """The counter ``worker``'s connections of kind ``connection`` consult, if the
        fault is theirs."""
        if (connection, worker, generation) != (self.connection, self.worker, self.generation):
            return None
        return FaultCounter(self)


class FaultCounter:
    """Counts one worker's frames of one kind; :meth:`sent` names the action for the
    frame that reaches the count, once. Thread-safe (channels send on their own
    threads)."""

    def __init__(self, fault: NetworkFault) -> None:
        self.fault = fault
        self._left = fault.after
        self._lock = threading.Lock()
        self.struck = threading.Event()

    def sent(self) -> str | None:
        """One frame is about to be sent: the fault's action if it strikes now."""
        with self._lock:
            if self._left <= 0:
                return None
            self._left -= 1
            if self._left:
                return None
        self.struck.set()
        return self.fault.action
