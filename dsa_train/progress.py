"""Where the library shows progress: one reporter for the whole process, a no-op by default.

The training loop, an evaluation and a dataset import ask :func:`current` for the reporter
and tell it what they do (an epoch starts, a step is done, an import advances); nobody passes
it down. Nothing is shown unless someone installs a reporter with :func:`reporting`, as the
command line does for the length of a command (its bars are ``cli/_output.ProgressReporter``).
Messages in words are not progress: they go through :mod:`logging` (a logger per module,
under ``dsa_train``).

This module imports nothing from dsa_train, so every layer (data, models, eval, train,
results) may use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol


class Reporter(Protocol):
    """What the library tells whoever shows its progress."""

    def epoch_start(self, epoch: int, epochs: int, steps: int, done: int) -> None: ...
    def step_done(self, steps: int, loss: float, rate: float, unit: str) -> None: ...
    def epoch_done(self, record: dict) -> None: ...
    def eval_start(self, split: str, total: int) -> None: ...
    def eval_advance(self, done: int) -> None: ...
    def eval_done(self, split: str, summary: str) -> None: ...
    def work_start(self, what: str, total: int) -> None: ...
    def work_advance(self, done: int) -> None: ...
    def work_done(self) -> None: ...


class SilentReporter:
    """The default: hears everything, shows nothing."""

    def epoch_start(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        pass

    def step_done(self, steps: int, loss: float, rate: float, unit: str) -> None:
        pass

    def epoch_done(self, record: dict) -> None:
        pass

    def eval_start(self, split: str, total: int) -> None:
        pass

    def eval_advance(self, done: int) -> None:
        pass

    def eval_done(self, split: str, summary: str) -> None:
        pass

    def work_start(self, what: str, total: int) -> None:
        pass

    def work_advance(self, done: int) -> None:
        pass

    def work_done(self) -> None:
        pass


class _Work:
    """The bar of the work in progress (an import's stage, a new disk table being written):
    ``what`` names it, ``done`` is how far the reporter was told it is."""

    def __init__(self) -> None:
        self.what, self.done, self.open = "", 0, False


_reporter: Reporter = SilentReporter()
_work = _Work()


def current() -> Reporter:
    """The reporter installed now (a :class:`SilentReporter` when none is)."""
    return _reporter


@contextlib.contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Install ``reporter`` for the duration of the block; the one before is back afterwards,
    also when the block raises. A bar of work still open at the end is closed."""
    global _reporter, _work
    before = _reporter, _work
    _reporter, _work = reporter, _Work()
    try:
        yield reporter
    finally:
        work_done()
        _reporter, _work = before


def work(what: str, done: int, total: int) -> None:
    """``done`` of ``total`` of the work ``what``: a new ``what`` is a bar of its own, closed
    when ``done`` reaches ``total`` (or when the next one starts)."""
    if _work.open and what != _work.what:
        work_done()
    if not _work.open:
        _reporter.work_start(what, total)
        _work.what, _work.done, _work.open = what, 0, True
    _reporter.work_advance(done - _work.done)
    _work.done = done
    if done >= total:
        work_done()


def work_done() -> None:
    """Close the bar of the work in progress, if one is open."""
    if _work.open:
        _work.open = False
        _reporter.work_done()
