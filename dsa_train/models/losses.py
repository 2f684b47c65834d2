r"""Losses over one positive score and a shared set of negative scores per query.

For query :math:`i` with positive score :math:`s_i` and negative scores :math:`s_{ij}`
(negatives equal to the query's own answer are masked out):

* ``cross_entropy``: :math:`-\log \frac{e^{s_i}}{e^{s_i} + \sum_j e^{s_{ij}}}`, a softmax
  over the answer and the negatives (sampled 1-vs-all);
* ``softplus``: :math:`\log(1 + e^{-s_i}) + \frac{1}{K}\sum_j \log(1 + e^{s_{ij}})`, the
  logistic loss;
* ``margin``: :math:`\frac{1}{K}\sum_j \max(0, \gamma - s_i + s_{ij})`, margin ranking.

Each is averaged over the queries; given ``total``, summed and divided by ``total`` instead
(one slice of a batch of ``total`` queries: the slices' losses add up to the batch's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def ranking_loss(
    kind: str, positive: Tensor, negative: Tensor, masked: Tensor, *, margin: float = 1.0, total: int | None = None
) -> Tensor:
    """``positive``: ``(B,)``; ``negative``: ``(B, K)``; ``masked``: ``(B, K)``, True to ignore."""
    reduce = (lambda per_query: per_query.mean()) if total is None else (lambda per_query: per_query.sum() / total)
    if kind == "cross_entropy":
        logits = torch.cat([positive[:, None], negative.masked_fill(masked, float("-inf"))], dim=1)
        target = torch.zeros(len(positive), dtype=torch.long, device=positive.device)
        return reduce(F.cross_entropy(logits, target, reduction="none")) if total is not None else F.cross_entropy(logits, target)
    keep = (~masked).to(negative.dtype)
    count = keep.sum(1).clamp_min(1)
    if kind == "softplus":
        return reduce(F.softplus(-positive) + (F.softplus(negative) * keep).sum(1) / count)
    if kind == "margin":
        return reduce((F.relu(margin - positive[:, None] + negative) * keep).sum(1) / count)
    raise ValueError(f"unknown loss {kind!r}")
