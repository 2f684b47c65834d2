r"""OGB's link-prediction protocol for ``ogbl-wikikg2`` and ``ogbl-biokg``: each query's answer
ranked against the split's own fixed negatives, unfiltered, exactly as ``ogb``'s ``Evaluator``
computes it (``ogb/linkproppred/evaluate.py``, ``Evaluator._eval_mrr``, torch branch, ogb 1.3.6).

Every test (or valid) triple :math:`(h, r, t)` asks a head query, ranked among ``head_neg``
(500 entities per triple in wikikg2), and a tail query, ranked among ``tail_neg``. The
answer's score and its negatives' scores come from one call of the model on the candidates
``[answer, negative_1, ..., negative_K]`` (as OGB's example code scores them), and

.. math::
    \mathrm{rank} = 1 + \tfrac12\bigl(\#\{j : s_j > s\} + \#\{j : s_j \ge s\}\bigr)

over the K negatives: **ties count half** (the mean of the optimistic and the pessimistic
rank), not filtered (a negative that happens to be a true answer still counts), a negative equal
to the answer itself counts as a tie. As in OGB, a NaN compares false with everything: a NaN
negative never outranks the answer, and a NaN answer ranks first (our filtered ranking ranks it
last; OGB does not, and a figure meant for its leaderboard must do what it does). Hits@k is
:math:`\mathrm{rank} \le k`, the reciprocal rank :math:`1/\mathrm{rank}` is taken in float32
(OGB's ``1./ranking_list.to(torch.float)``), and MRR and Hits@k are means over every query,
head and tail queries together (OGB's examples concatenate both lists before the mean).

OGB's numpy branch of the same method calls ``sum(dim=1)`` on arrays and cannot run (numpy
takes ``axis``); only its torch branch is reproduced. ``scripts/peers/ogb_evaluator_fixture.py``
records that branch's output on random scores with ties, and ``tests/test_ogb_protocol.py``
checks this module against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor

HITS = (1, 3, 10)

#: score_each(anchor ids (B,), relation ids (B,), candidate ids (B, K), side) -> (B, K) scores
ScoreEach = Callable[[Tensor, Tensor, Tensor, str], Tensor]


def ogb_ranks(positive: Tensor, negative: Tensor) -> Tensor:
    """OGB's rank of each ``positive[i]`` among ``negative[i, :]`` (float32, see the module
    docstring): ``0.5 * (#greater + #greater_or_equal) + 1``."""
    positive = positive.reshape(-1, 1)
    optimistic = (negative > positive).sum(dim=1)
    pessimistic = (negative >= positive).sum(dim=1)
    return 0.5 * (optimistic + pessimistic) + 1


@dataclass
class OgbMetrics:
    """OGB's figures: MRR and Hits@1/3/10 over every query (head and tail), and how many."""

    mrr: float
    hits_at_1: float
    hits_at_3: float
    hits_at_10: float
    queries: int

    @classmethod
    def of(cls, ranks: Tensor) -> OgbMetrics:
        if not len(ranks):
            return cls(*(float("nan"),) * 4, 0)
        ranks = ranks.to(torch.float32)
        hits = [(ranks <= k).to(torch.float).mean().item() for k in HITS]
        return cls((1.0 / ranks).mean().item(), *hits, len(ranks))

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate_ogb(
    score_each: ScoreEach,
    triples: Tensor,
    head_neg: np.ndarray,
    tail_neg: np.ndarray,
    *,
    batch_size: int = 64,
    progress: Callable[[int], None] | None = None,
) -> OgbMetrics:
    """OGB's MRR and Hits@k of ``triples`` (``(M, 3)`` global ids), head queries ranked among
    ``head_neg[i]`` and tail queries among ``tail_neg[i]`` (``(M, K)`` global ids, read a
    window at a time: they may be memory-mapped). ``progress(n)`` after every batch."""
    if head_neg.shape[0] != len(triples) or tail_neg.shape[0] != len(triples):
        raise ValueError(
            f"the fixed negatives have {head_neg.shape[0]:,} (head) and {tail_neg.shape[0]:,} (tail) rows for "
            f"{len(triples):,} triples: they must be the split's own"
        )
    ranks = []
    for side, negatives in (("head", head_neg), ("tail", tail_neg)):
        anchor_col, answer_col = (2, 0) if side == "head" else (0, 2)
        for start in range(0, len(triples), batch_size):
            window = slice(start, min(start + batch_size, len(triples)))
            rows = triples[window].long()
            fixed = torch.from_numpy(np.ascontiguousarray(negatives[window])).long()
            candidates = torch.cat([rows[:, answer_col, None], fixed], dim=1)
            scores = score_each(rows[:, anchor_col], rows[:, 1], candidates, side).cpu()
            ranks.append(ogb_ranks(scores[:, 0], scores[:, 1:]))
            if progress is not None:
                progress(len(rows))
    return OgbMetrics.of(torch.cat(ranks) if ranks else torch.empty(0))
