"""The one number an evaluation is judged by: filtered MRR for knowledge graphs, accuracy for
node classification, AUC for held-out links and clicks; higher is better for each. Choosing
the best evaluation of a run (``eval.select_best``), stopping a run that no longer improves
(``eval.patience``) and ``dsa-train tune``'s search all read it here."""

from __future__ import annotations

import math

#: Where the objective is found in an evaluation's metrics: (group, metric, label).
OBJECTIVES = (
    ("both", "mrr", "MRR"),
    ("ogb", "mrr", "OGB MRR"),  # eval.protocol: ogb (with both, the filtered MRR above comes first)
    ("classifier", "accuracy", "accuracy"),
    ("probe", "accuracy", "probe accuracy"),
    ("link", "auc", "link AUC"),
    ("clicks", "auc", "AUC"),
)


def objective_of(metrics: dict) -> tuple[str, float] | None:
    """The objective's label and value in an evaluation's ``metrics`` (or its metrics record),
    ``None`` if it holds none (a split with nothing to score)."""
    for group, name, label in OBJECTIVES:
        value = metrics.get(group, {}).get(name) if isinstance(metrics.get(group), dict) else None
        if isinstance(value, (int, float)) and math.isfinite(value):
            return label, float(value)
    return None
