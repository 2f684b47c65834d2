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

Label smoothing :math:`\varepsilon` (``cross_entropy`` only) spreads a share :math:`\varepsilon` of
the target evenly over the query's :math:`n_i` candidates (the answer and its unmasked
negatives), as torch's ``F.cross_entropy(label_smoothing=...)`` does over its classes:

.. math::
    \ell_i = \log \sum_{c} e^{s_{ic}} - (1 - \varepsilon)\, s_i - \frac{\varepsilon}{n_i} \sum_{c} s_{ic}.

:func:`every_entity_loss` is the same three losses with every entity a candidate (1-vs-all)
and a set :math:`Y_i` of answers per query (k-vs-all; 1-vs-all is :math:`|Y_i| = 1`), scored
a chunk of entities at a time so that a step never holds the whole query x entity matrix:

* ``cross_entropy``: :math:`\log \sum_{j} e^{s_{ij}} - \frac{1}{|Y_i|}\sum_{y \in Y_i} s_{iy}`,
  the cross-entropy of the softmax over all entities against the target spread evenly over
  the answers (LibKGE's KvsAll with its ``kl`` loss, up to a constant; for one answer,
  :math:`-\log` softmax);
* ``softplus``: :math:`\frac{1}{|Y_i|}\sum_{y \in Y_i} \log(1 + e^{-s_{iy}}) +
  \frac{1}{E - |Y_i|}\sum_{j \notin Y_i} \log(1 + e^{s_{ij}})`, binary cross-entropy with
  the answers and the other entities weighted equally;
* ``margin`` (one answer only): :math:`\frac{1}{E - 1}\sum_{j \ne y} \max(0, \gamma - s_{iy} + s_{ij})`.

With label smoothing :math:`\varepsilon` the cross-entropy's target is :math:`(1 - \varepsilon)` spread
over the answers and :math:`\varepsilon / E` on every entity (the answers included):
:math:`\log \sum_j e^{s_{ij}} - \frac{1 - \varepsilon}{|Y_i|}\sum_{y \in Y_i} s_{iy} -
\frac{\varepsilon}{E}\sum_j s_{ij}`; with one answer, torch's ``F.cross_entropy`` with
``label_smoothing`` over all entities (the smoothing of ConvE, TuckER and LibKGE's KvsAll).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def ranking_loss(
    kind: str,
    positive: Tensor,
    negative: Tensor,
    masked: Tensor,
    *,
    margin: float = 1.0,
    total: int | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """``positive``: ``(B,)``; ``negative``: ``(B, K)``; ``masked``: ``(B, K)``, True to ignore."""
    reduce = (lambda per_query: per_query.mean()) if total is None else (lambda per_query: per_query.sum() / total)
    if kind == "cross_entropy" and label_smoothing:
        logits = torch.cat([positive[:, None], negative.masked_fill(masked, float("-inf"))], dim=1)
        kept = torch.cat([positive.new_ones(len(positive), 1), (~masked).to(negative.dtype)], dim=1)
        spread = (torch.cat([positive[:, None], negative], dim=1) * kept).sum(1) / kept.sum(1)
        return reduce(logits.logsumexp(1) - (1 - label_smoothing) * positive - label_smoothing * spread)
    if kind == "cross_entropy":
        logits = torch.cat([positive[:, None], negative.masked_fill(masked, float("-inf"))], dim=1)
        target = torch.zeros(len(positive), dtype=torch.long, device=positive.device)
        return (
            reduce(F.cross_entropy(logits, target, reduction="none"))
            if total is not None
            else F.cross_entropy(logits, target)
        )
    keep = (~masked).to(negative.dtype)
    count = keep.sum(1).clamp_min(1)
    if kind == "softplus":
        return reduce(F.softplus(-positive) + (F.softplus(negative) * keep).sum(1) / count)
    if kind == "margin":
        return reduce((F.relu(margin - positive[:, None] + negative) * keep).sum(1) / count)
    raise ValueError(f"unknown loss {kind!r}")


def every_entity_loss(
    kind: str,
    score_chunk: Callable[[int, int], Tensor],
    answer_scores: Tensor,
    label_query: Tensor,
    label_entity: Tensor,
    *,
    num_queries: int,
    num_entities: int,
    chunk: int,
    margin: float = 1.0,
    label_smoothing: float = 0.0,
) -> Tensor:
    """The mean over ``num_queries`` queries of ``kind`` against every entity (module docstring).

    ``score_chunk(start, stop)`` gives the ``(Q, stop - start)`` scores of every query against
    entities ``start .. stop - 1``; the labels are the pairs ``(label_query[k],
    label_entity[k])``, each scored directly in ``answer_scores[k]`` (every query has at
    least one). Entities are scored ``chunk`` at a time; with more than one chunk each is
    recomputed in the backward pass (activation checkpointing) rather than kept, so a step
    holds one chunk's scores at a time.
    """
    if kind == "margin" and len(label_query) != num_queries:
        raise ValueError("the margin loss takes one answer per query")
    positive_of_query = answer_scores if kind == "margin" else None  # one answer each, in query order

    def reduce(start: int, stop: int) -> Tensor:
        scores = score_chunk(start, stop)
        inside = (label_entity >= start) & (label_entity < stop)
        labelled = torch.zeros_like(scores, dtype=torch.bool)
        labelled[label_query[inside], label_entity[inside] - start] = True
        if kind == "cross_entropy":  # the answers' own terms are added below, once
            others = scores.masked_fill(labelled, torch.finfo(scores.dtype).min).logsumexp(1)
            return torch.stack([others, scores.sum(1)], 1) if label_smoothing else others
        keep = (~labelled).to(scores.dtype)
        if kind == "softplus":
            return (F.softplus(scores) * keep).sum(1)
        if kind == "margin":
            return (F.relu(margin - positive_of_query[:, None] + scores) * keep).sum(1)
        raise ValueError(f"unknown loss {kind!r}")

    bounds = [(start, min(start + chunk, num_entities)) for start in range(0, num_entities, chunk)]
    if len(bounds) == 1:
        negative = reduce(*bounds[0])[:, None]
    else:
        negative = torch.stack([checkpoint(reduce, start, stop, use_reentrant=False) for start, stop in bounds], 1)
    zeros = answer_scores.new_zeros(num_queries)
    answers = zeros.index_add(0, label_query, torch.ones_like(answer_scores))
    if kind == "cross_entropy":
        every_score = None
        if label_smoothing:  # each chunk gave (logsumexp of the others, sum of every score)
            negative, every_score = negative[..., 0], negative[..., 1].sum(1)
        top = zeros.scatter_reduce(0, label_query, answer_scores.detach(), "amax", include_self=False)
        answers_lse = zeros.index_add(0, label_query, (answer_scores - top[label_query]).exp()).log() + top
        answers_mean = zeros.index_add(0, label_query, answer_scores) / answers
        if every_score is None:
            per_query = torch.logaddexp(negative.logsumexp(1), answers_lse) - answers_mean
        else:
            per_query = (
                torch.logaddexp(negative.logsumexp(1), answers_lse)
                - (1 - label_smoothing) * answers_mean
                - label_smoothing * every_score / num_entities
            )
    elif kind == "softplus":
        per_query = zeros.index_add(0, label_query, F.softplus(-answer_scores)) / answers + negative.sum(1) / (
            num_entities - answers
        ).clamp_min(1)
    else:
        per_query = negative.sum(1) / max(num_entities - 1, 1)
    return per_query.mean()
