"""The reference run's progress on its terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["Progress"]


class Progress:
    """A rich progress bar on a terminal, plain lines every ``log_every`` steps otherwise."""

    def __init__(self, enabled: bool, start: int, total: int, log_every: int, out: Callable[[str], None]) -> None:
        self.enabled, self.total, self.log_every, self.out = enabled, total, log_every, out
        self.bar = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("train", total=total, completed=start, info="")

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if not self.enabled:
            return
        info = f"loss {loss:.4f}  {tok_s:,.0f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif step % self.log_every == 0 or step == self.total:
            self.out(f"step {step}/{self.total}  {info}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
