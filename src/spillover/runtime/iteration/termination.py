"""When a loop is done: the coordinator's half of the termination protocol.

Each iteration head, once its regular input ended, runs rounds: it sends a
``LoopProbe`` in line behind its output, loop tasks pass it on once it came on
all their loop channels, and it returns over the feedback edge behind every
record derived from what the head emitted before it. A round is *quiet* at a
head when no record came back between sending its probe and the probe's return
on every feedback channel. Once every head of the loop reported the same round
quiet, no record is left in the loop (docs/iterations.md gives the argument),
and the coordinator tells the heads to end it. No timeout is involved.
"""

from __future__ import annotations


class LoopTermination:
    """Quiet rounds per loop (keyed by the head's uid) until one is quiet at every
    head subtask."""

    def __init__(self, heads: dict[str, int]) -> None:
        self.parallelism = dict(heads)
        self._quiet: dict[str, dict[int, set[int]]] = {uid: {} for uid in heads}
        self._latest: dict[str, dict[int, int]] = {uid: {} for uid in heads}
        self.done: dict[str, int] = {}  # loop -> the round that ended it

    def quiet(self, uid: str, subtask: int, round: int) -> bool:
        """Records a quiet round; True once (for the loop) when every head had it."""
        rounds = self._quiet.get(uid)
        if rounds is None or uid in self.done:
            return False
        heads = rounds.setdefault(round, set())
        heads.add(subtask)
        if len(heads) == self.parallelism[uid]:
            self.done[uid] = round
            rounds.clear()
            return True
        # A head reports its quiet rounds in order: a round below every head's
        # latest that some head did not report was not quiet there, so it can never
        # complete and is forgotten.
        latest = self._latest[uid]
        latest[subtask] = max(round, latest.get(subtask, round))
        if len(latest) == self.parallelism[uid]:
            low = min(latest.values())
            for r in [r for r in rounds if r < low]:
                del rounds[r]
        return False
