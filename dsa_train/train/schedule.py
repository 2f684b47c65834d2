r"""The learning-rate schedule: the rate of each step as a function of the step alone.

With base rate :math:`\eta`, final ratio :math:`r` (``optimizer.final_lr_ratio``), step
:math:`s` (counted from 0) of :math:`S` (the recipe's epochs times its steps per epoch) and
progress :math:`p = s / S`:

- ``constant``: :math:`\eta_s = \eta`;
- ``linear``: :math:`\eta_s = \eta\,(1 - (1 - r)\,p)`;
- ``cosine``: :math:`\eta_s = \eta\,\bigl(r + (1 - r)\,\tfrac{1}{2}(1 + \cos \pi p)\bigr)`
  (Loshchilov & Hutter 2017, without restarts);
- ``step``: :math:`\eta_s = \eta` for :math:`s < M`, then :math:`r\eta`, where :math:`M` is the
  steps of the first ``optimizer.decay_after_epochs`` epochs (torch's ``MultiStepLR`` with one
  milestone). The rate of a step does not depend on :math:`S`: a run given fewer epochs
  (``--set train.epochs=5`` for a quick look) is the prefix of the recipe's run, and one given
  more keeps the lower rate to its end.

- ``plateau``: :math:`\eta_s = \eta f_s`, where :math:`f` starts at 1 and, at an evaluation
  during training, becomes :math:`\max(f \cdot \phi, r)` (:math:`\phi`:
  ``optimizer.plateau_factor``) once more than ``optimizer.plateau_patience`` evaluations in a
  row were no better than the best so far; the count then starts again (torch's
  ``ReduceLROnPlateau`` in mode ``max`` with no threshold and no cooldown, on the evaluation's
  MRR, accuracy or AUC). It depends on the evaluations, so its state :math:`(f,` best, count)
  is :func:`plateau_update`'s, kept in every checkpoint.

The two decays start at :math:`\eta` and end near :math:`r\eta`. The rate is a pure function of
the step, so a resumed run (or one rank of a torchrun job) sets the same rate at the same step
as an uninterrupted run, with nothing stored; a run stopped by ``train.max_steps`` is the
prefix of the full schedule. torch's ``lr_scheduler`` classes carry their position as state
and advance by calls, which the checkpoint would then have to store: this closed form is the
whole of it.
"""

from __future__ import annotations

import math


def lr_factor(schedule: str, step: int, total_steps: int, final_ratio: float, milestone: int = 0) -> float:
    """The multiple of the base rate at ``step`` (0-based) of ``total_steps``; ``milestone``:
    with ``step``, the first step at ``final_ratio``."""
    if schedule == "constant" or total_steps <= 0:
        return 1.0
    if schedule == "step":
        return final_ratio if step >= milestone else 1.0
    progress = min(step / total_steps, 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - final_ratio) * progress
    if schedule == "cosine":
        return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


def plateau_update(state: dict | None, value: float, cfg) -> dict:
    """The ``plateau`` schedule's state ``{"factor", "best", "bad"}`` (``None``: a run's
    start) after an evaluation scoring ``value``; ``cfg``: the recipe's optimizer section
    (``plateau_factor``, ``plateau_patience``, ``final_lr_ratio``)."""
    state = dict(state or {"factor": 1.0, "best": None, "bad": 0})
    if state["best"] is None or value > state["best"]:
        state["best"], state["bad"] = value, 0
    else:
        state["bad"] += 1
    if state["bad"] > cfg.plateau_patience:
        state["factor"], state["bad"] = max(state["factor"] * cfg.plateau_factor, cfg.final_lr_ratio), 0
    return state
