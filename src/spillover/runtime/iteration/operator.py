"""The iteration head's operator: where a loop's input and its feedback meet."""

from __future__ import annotations

from spillover.runtime.api import Batch, Operator


class IterationHead(Operator):
    """Passes the loop's regular input (input 0) and its feedback (input 1) on into
    the loop body, unchanged. ``DataStream.iterate()`` adds it; its task is the
    iteration head (``runtime/iteration/head.py``), which logs the feedback during
    checkpoints and ends the loop once no record is left in it."""

    REGULAR, FEEDBACK = 0, 1

    def __init__(self, dtype: object) -> None:
        self.out_dtype = dtype

    def process(self, batch: Batch, input_index: int = 0) -> None:
        self.ctx.output.emit(batch)
