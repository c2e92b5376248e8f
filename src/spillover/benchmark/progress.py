"""Progress of the runs on the terminal: a ``rich`` bar redrawn in place, or one
plain line per run in a log."""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn


class ProgressBar:
    """Which run is going and how far, on ``stream`` (stderr by default).

    On a terminal a ``rich`` progress bar is redrawn in place (the current run, its
    phase, and the total); otherwise (a log, a pipe) each run prints one plain line
    when it starts.
    """

    def __init__(
        self,
        runs: int,
        run_s: float,
        warmup_s: float = 0.0,
        stream: TextIO | None = None,
        tty: bool | None = None,
        width: int = 20,
        rounds: int = 1,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.runs, self.run_s, self.warmup_s, self.width = runs, run_s, warmup_s, width
        self.rounds = rounds
        self.index = 0
        self.label = ""
        self._lock = threading.Lock()
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def start(self, executor: str, policy: str, round_: int = 1) -> None:
        """Run ``index + 1`` of ``runs`` begins (in round ``round_`` of ``rounds``)."""
        self.index += 1
        where = f"round {round_}/{self.rounds} " if self.rounds > 1 else ""
        self.label = f"{where}{executor} {policy}"
        if self.tty:
            self.update(0.0)
            return
        done = (self.index - 1) * self.run_s
        print(
            f"[{self.index}/{self.runs}] {self.label}: {self.run_s:g} s "
            f"(total {done:g}/{self.runs * self.run_s:g} s)",
            file=self.stream,
            flush=True,
        )

    def update(self, elapsed: float) -> None:
        """The current run has gone ``elapsed`` seconds (drawn on a terminal only)."""
        if not self.tty:
            return
        e = min(max(elapsed, 0.0), self.run_s)
        total = (self.index - 1) * self.run_s + e
        phase = "warm-up" if e < self.warmup_s else "measuring"
        with self._lock:
            if self._progress is None:
                console = Console(file=self.stream, force_terminal=True, highlight=False)
                self._progress = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(bar_width=self.width),
                    TextColumn("{task.fields[status]}"),
                    console=console,
                    auto_refresh=False,
                    transient=True,
                )
                self._progress.start()
                self._task = self._progress.add_task("", total=self.run_s, status="")
            assert self._task is not None
            self._progress.update(
                self._task,
                completed=e,
                description=f"[{self.index}/{self.runs}] "
                + self.label.ljust(36 if self.rounds > 1 else 24),
                status=f"{e:3.0f}/{self.run_s:g} s {phase:<9}, "
                f"total {total:.0f}/{self.runs * self.run_s:g} s",
            )
            self._progress.refresh()

    def clear(self) -> None:
        """Removes the bar, so other output starts on a clean line."""
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
                self._progress = None
                self._task = None
