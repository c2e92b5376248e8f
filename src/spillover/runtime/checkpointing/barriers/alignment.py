"""What one alignment cost: the coordinator's per-checkpoint metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AlignmentStats:
    """When the first barrier of a checkpoint came, when the last did, and the bytes
    processed from still-open channels in between."""

    checkpoint_id: int
    first_barrier_at: float  # time.monotonic()
    aligned_at: float = 0.0
    bytes_during_alignment: int = 0

    @property
    def alignment_seconds(self) -> float:
        return max(0.0, self.aligned_at - self.first_barrier_at)
