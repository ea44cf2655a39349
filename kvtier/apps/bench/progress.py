"""One live display for a bench run: a row per target (bar, requests done, last TTFT, cached tokens).

Targets run one after the other or side by side; either way they share one ``rich`` live display, so their
rows never overwrite each other. On a terminal the rows redraw in place; elsewhere (a log, CI) rich prints
the final rows once, when the run ends.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class TargetRow:
    """The row of one target: ``advance`` after each request."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self._progress = progress
        self._task = task

    def advance(self, ttft_s: float | None, cached_tokens: int | None) -> None:
        fields = {}
        if ttft_s is not None:
            fields = {"ttft": f"TTFT {ttft_s * 1000:,.0f} ms", "cached": f"cached {cached_tokens or 0:,}"}
        self._progress.update(self._task, advance=1, **fields)


class BenchProgress:
    """A context manager holding the live display; ``row(label, total)`` adds a target's row."""

    def __init__(self, console: Console | None = None) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}", justify="left"), BarColumn(bar_width=24),
            MofNCompleteColumn(), TextColumn("{task.fields[ttft]}"), TextColumn("{task.fields[cached]}"),
            TimeElapsedColumn(), console=console or Console(stderr=True))

    def row(self, label: str, total: int) -> TargetRow:
        task = self.progress.add_task(label, total=total, ttft="TTFT -", cached="")
        return TargetRow(self.progress, task)

    def __enter__(self) -> BenchProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()
