r"""Evaluating node embeddings: a logistic-regression probe and link prediction.

**Probe** (node classification): multinomial logistic regression on the frozen embeddings of
the training nodes, with scikit-learn's default objective (:math:`C = 1`,
:math:`\frac{1}{2}\lVert W \rVert^2 + C \sum_i \mathrm{CE}_i`, intercept unpenalised), fitted with
L-BFGS in float64, scored by accuracy on the other splits' nodes. This is what PyG's
``Node2Vec.test`` does with scikit-learn, in torch.

**Link prediction**: each held-out edge :math:`(u, v)` is scored :math:`s(u, v)` (the dot
product of the two nodes' representations). AUC compares it with one random pair
:math:`(u, w)` per edge (ties count one half); MRR and Hits@10 rank it against
``negatives`` random nodes :math:`w` as :math:`(u, w)`, ties ranked realistically (the mean
of the optimistic and pessimistic rank).

At scale both run on bounded samples (``train/node2vec.py`` picks at most 20,000 nodes per
split for the probe and 50,000 held-out edges, seeded, and reports how many of how many),
and link prediction scores its pairs in blocks of :data:`SCORED_PAIRS`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

#: Node pairs scored at once by link prediction (their representations are gathered).
SCORED_PAIRS = 1 << 18


@torch.no_grad()
def probe_accuracy(
    embeddings: Tensor, labels: Tensor, train_mask: Tensor, masks: dict[str, Tensor], *, max_iter: int = 150
) -> dict[str, float]:
    x = embeddings.double()
    y = labels.long()
    classes = int(y.max()) + 1
    weight = torch.zeros(x.shape[1], classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe", tolerance_grad=1e-6)
    xt, yt = x[train_mask], y[train_mask]

    def objective():
        optimizer.zero_grad()
        with torch.enable_grad():
            loss = F.cross_entropy(xt @ weight + bias, yt, reduction="sum") + 0.5 * weight.pow(2).sum()
            loss.backward()
        return loss

    optimizer.step(objective)
    predicted = (x @ weight + bias).argmax(1)
    return {
        name: float((predicted[m] == y[m]).double().mean())
        for name, m in {"train": train_mask, **masks}.items()
        if m is not None and m.any()
    }


@torch.no_grad()
def link_prediction(
    score: Callable[[Tensor, Tensor], Tensor], edges: Tensor, num_nodes: int, *, negatives: int = 100, seed: int = 0
) -> dict[str, float]:
    """``score(u, v)``: scores of node pairs. AUC, MRR and Hits@10 of the held-out ``edges``."""
    generator = torch.Generator().manual_seed(seed)
    u, v = edges[:, 0], edges[:, 1]
    positive = score(u, v)
    negative_pairs = score(u, torch.randint(0, num_nodes, (len(u),), generator=generator))
    auc = _auc(positive, negative_pairs)
    rivals = torch.randint(0, num_nodes, (len(u), negatives), generator=generator)
    rank = torch.empty(len(u), dtype=torch.float64)
    rows = max(1, SCORED_PAIRS // max(negatives, 1))
    for start in range(0, len(u), rows):  # a bounded number of pairs scored at once
        end = min(len(u), start + rows)
        pairs = score(u[start:end, None].expand(-1, negatives).reshape(-1), rivals[start:end].reshape(-1))
        rival_scores, target = pairs.view(end - start, negatives), positive[start:end, None]
        rank[start:end] = 1 + ((rival_scores > target).sum(1) + (rival_scores >= target).sum(1)).double() / 2
    return {
        "auc": auc,
        "mrr": float((1 / rank).mean()),
        "hits_at_10": float((rank <= 10).double().mean()),
        "edges": len(edges),
    }


def _auc(positive: Tensor, negative: Tensor) -> float:
    """Probability that a positive outscores a negative, ties counting one half: the
    Mann-Whitney U of the positives' average ranks (``tests/test_graphs.py`` checks it
    against scikit-learn's ``roc_auc_score``)."""
    from scipy.stats import rankdata  # here, not at the top: importing scipy.stats takes about 0.5 s

    ranks = rankdata(torch.cat([positive, negative]).double().cpu().numpy())
    n_pos, n_neg = len(positive), len(negative)
    return float((ranks[:n_pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
