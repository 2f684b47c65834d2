"""Progress on stderr (bars on a terminal, one line per epoch otherwise); tables on stdout."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

if TYPE_CHECKING:
    from ..eval import RankingMetrics

# Piped or redirected output gets wide lines instead of the 80 columns rich assumes.
stderr = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
stdout = Console(width=None if sys.stdout.isatty() else 120)


class ProgressReporter:
    """The training loop's Reporter for a person watching: rich bars, or plain lines in a log."""

    def __init__(self) -> None:
        self.live = sys.stderr.isatty()
        self._progress: Progress | None = None
        self._task = None
        self._loss = None

    def _bar(self, description: str, total: int, done: int = 0) -> None:
        self._close()
        if not self.live:
            return
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=stderr,
        )
        self._progress.start()
        self._task = self._progress.add_task(description, total=total, completed=done, info="")

    def _close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def note(self, text: str) -> None:
        stderr.print(text, highlight=False)

    def epoch_start(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        self._loss = None
        self._bar(f"epoch {epoch}/{epochs}", steps, done)

    def step_done(self, steps: int, loss: float, triples_per_s: float) -> None:
        self._loss = loss if self._loss is None else 0.95 * self._loss + 0.05 * loss
        if self._progress is not None:
            self._progress.update(self._task, advance=steps, info=f"loss {self._loss:.4f}  {triples_per_s:,.0f} triples/s")

    def epoch_done(self, record: dict) -> None:
        self._close()
        stderr.print(
            f"epoch {record['epoch']}: loss {record['loss']:.4f}, {record['triples_per_s']:,.0f} triples/s, "
            f"{record['seconds']:.1f} s",
            highlight=False,
        )

    def eval_start(self, split: str, queries: int) -> None:
        self._bar(f"ranking {split}", queries)

    def eval_advance(self, queries: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=queries)

    def eval_done(self, split: str, metrics: dict[str, RankingMetrics]) -> None:
        self._close()
        both = metrics["both"]
        stderr.print(
            f"{split}: MRR {both.mrr:.4f}, Hits@1 {both.hits_at_1:.4f}, Hits@10 {both.hits_at_10:.4f}, MR {both.mr:.1f}",
            highlight=False,
        )


def metrics_table(title: str, metrics: dict[str, RankingMetrics]) -> Table:
    table = Table(title=title)
    table.add_column("queries", justify="left")
    for column in ("count", "MR", "MRR", "Hits@1", "Hits@3", "Hits@10"):
        table.add_column(column, justify="right")
    for side, m in metrics.items():
        table.add_row(
            side, f"{m.queries:,}", f"{m.mr:.1f}", f"{m.mrr:.4f}", f"{m.hits_at_1:.4f}", f"{m.hits_at_3:.4f}", f"{m.hits_at_10:.4f}"
        )
    return table
