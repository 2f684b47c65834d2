"""A search's time budget shared among its trials: with ``--timeout``, each trial trains at
most its share, so that a search of a stated length completes trials instead of spending the
budget on one (a trial that cannot finish in the budget teaches nothing)."""

from __future__ import annotations

#: The trials a ``--timeout`` without ``--trials`` is shared among: enough for the median
#: pruner's two startup trials and a few of the sampler's own choices.
TRIALS_IN_BUDGET = 10


def trial_share(seconds: float | None, trials: int | None, jobs: int) -> float | None:
    """The seconds one trial may train: ``seconds`` over the trials planned (``trials``, else
    :data:`TRIALS_IN_BUDGET`), ``jobs`` of them at a time; ``None`` without a time budget."""
    if seconds is None:
        return None
    return seconds * jobs / (trials or TRIALS_IN_BUDGET)
