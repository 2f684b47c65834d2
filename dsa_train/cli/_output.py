"""Progress and the library's messages on stderr (bars on a terminal, one line per epoch
otherwise); tables on stdout."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..progress import Reporter, SilentReporter, reporting

# Piped or redirected output gets wide lines instead of the 80 columns rich assumes.
stderr = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
stdout = Console(width=None if sys.stdout.isatty() else 120)


class ProgressReporter:
    """The library's :class:`~dsa_train.progress.Reporter` for a person watching: rich bars, or
    plain lines in a log."""

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

    def epoch_start(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        self._loss = None
        self._bar(f"epoch {epoch}/{epochs}", steps, done)

    def step_done(self, steps: int, loss: float, rate: float, unit: str) -> None:
        self._loss = loss if self._loss is None else 0.95 * self._loss + 0.05 * loss
        if self._progress is not None:
            self._progress.update(self._task, advance=steps, info=f"loss {self._loss:.4f}  {rate:,.0f} {unit}/s")

    def epoch_done(self, record: dict) -> None:
        self._close()
        stderr.print(
            f"epoch {record['epoch']}: loss {record['loss']:.4f}, {record['items_per_s']:,.0f} {record['unit']}/s, "
            f"{record['seconds']:.1f} s",
            highlight=False,
        )

    def eval_start(self, split: str, total: int) -> None:
        self._bar(f"evaluating {split}", total)

    def eval_advance(self, done: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=done)

    def eval_done(self, split: str, summary: str) -> None:
        self._close()
        stderr.print(f"{split}: {summary}", highlight=False)

    def work_start(self, what: str, total: int) -> None:
        self._bar(what, total)

    def work_advance(self, done: int) -> None:
        self.eval_advance(done)

    def work_done(self) -> None:
        self._close()


class NotesHandler(logging.Handler):
    """The library's log records as the command line shows them: the message alone on
    stderr, no level or time; ``kept`` (if given) collects them too (``eval --json``)."""

    def __init__(self, *, shown: bool = True, kept: list[str] | None = None) -> None:
        super().__init__(logging.INFO)
        self.shown, self.kept = shown, kept

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if self.kept is not None:
            self.kept.append(text)
        if self.shown:
            stderr.print(text, highlight=False)


@contextlib.contextmanager
def command_output(
    reporter: Reporter | None = None, *, shown: bool = True, kept: list[str] | None = None
) -> Iterator[None]:
    """For one command: the ``dsa_train`` logger's INFO records and up go through one
    :class:`NotesHandler`, and ``reporter`` (default: none shown) draws the progress. Both are
    removed when the command ends. The records stop there (a root handler that something
    installed would print them twice). ``shown=False``: the library keeps quiet (a rank
    other than 0 of a torchrun job; tune's trials)."""
    logger = logging.getLogger("dsa_train")
    handler, level, propagate = NotesHandler(shown=shown, kept=kept), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        with reporting(reporter or SilentReporter()):
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


NAMES = {"mr": "MR", "mrr": "MRR", "hits_at_1": "Hits@1", "hits_at_3": "Hits@3", "hits_at_10": "Hits@10", "auc": "AUC"}


def metrics_table(title: str, metrics: dict[str, dict]) -> Table:
    """One row per group of metrics (tail/head/both queries, probe, link...), one column per metric."""
    table = Table(title=title)
    table.add_column("", justify="left")
    columns = list(dict.fromkeys(k for group in metrics.values() for k in group))
    for column in columns:
        table.add_column(NAMES.get(column, column.replace("_", " ")), justify="right")
    for name, group in metrics.items():
        table.add_row(name, *[_cell(group.get(c)) for c in columns])
    return table


def print_final_metrics(name: str, final_metrics: dict[str, dict]) -> None:
    """The final evaluation's tables on stdout, one per split that measured something (a graph
    with no labels and no held-out edges has nothing to show, and says so on stderr)."""
    for split, metrics in final_metrics.items():
        if metrics:
            stdout.print(metrics_table(f"{name}: {split}", metrics))


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.1f}" if value >= 10 else f"{value:.4f}"
