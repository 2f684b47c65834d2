r"""Click-prediction metrics: ROC AUC, log loss and normalised entropy.

* **AUC**, the probability that a random clicked impression scores above a random unclicked
  one (ties count one half), by the Mann-Whitney rank sum: with :math:`R_i` the average rank
  of score :math:`i` among all :math:`n` scores (ties share their mean rank), :math:`P`
  clicked and :math:`N` unclicked impressions,

  .. math:: \mathrm{AUC} = \frac{\sum_{i:\,y_i = 1} R_i - P(P + 1)/2}{P N}.

* **Log loss**, :math:`-\frac1n \sum_i y_i \log \sigma(z_i) + (1 - y_i) \log(1 - \sigma(z_i))`
  from the logits :math:`z_i`, computed stably as the mean of
  :math:`\mathrm{softplus}(z_i) - y_i z_i`.

* **Normalised entropy** (He et al. 2014, Facebook's ad clicks): the log loss over the log
  loss of always predicting the split's click rate :math:`p`,
  :math:`-p \log p - (1 - p) \log(1 - p)`; below 1 means better than the base rate.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def auc(scores: Tensor, labels: Tensor) -> float:
    """ROC AUC of ``scores`` for binary ``labels`` (NaN if one class is absent)."""
    scores, labels = scores.double().reshape(-1), labels.reshape(-1).bool()
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if not positives or not negatives:
        return math.nan
    distinct, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # rank of each distinct score's last copy (1-based)
    mean_rank = ends - (counts.double() - 1) / 2
    rank_sum = float(mean_rank[inverse][labels].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def log_loss(logits: Tensor, labels: Tensor) -> float:
    """Mean binary cross-entropy of the click probabilities ``sigmoid(logits)``."""
    logits, labels = logits.double().reshape(-1), labels.double().reshape(-1)
    return float((torch.nn.functional.softplus(logits) - labels * logits).mean())


def base_entropy(labels: Tensor) -> float:
    """Log loss of always predicting the click rate of ``labels``."""
    p = float(labels.double().mean())
    return 0.0 if p in (0.0, 1.0) else -(p * math.log(p) + (1 - p) * math.log(1 - p))


def click_metrics(logits: Tensor, labels: Tensor, true_logits: Tensor | None = None) -> dict:
    """AUC, log loss, normalised entropy and click rate of a split's predictions; with the
    generator's ``true_logits``, the AUC and log loss they reach (the best possible)."""
    loss, entropy = log_loss(logits, labels), base_entropy(labels)
    metrics = {
        "auc": auc(logits, labels),
        "log_loss": loss,
        "normalized_entropy": loss / entropy if entropy else math.nan,
        "click_rate": float(labels.double().mean()),
        "impressions": len(labels),
    }
    if true_logits is not None:
        metrics["best_auc"] = auc(true_logits, labels)
        metrics["best_log_loss"] = log_loss(true_logits, labels)
    return metrics
