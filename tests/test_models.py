"""Score functions and losses: every code path agrees with the per-triple definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsa_train.models.kge import DistMult, TransE
from dsa_train.models.losses import ranking_loss

N, R, D = 30, 4, 8


def models():
    return [
        TransE(N, R, D, p_norm=1, reciprocal=False, init_std=0.5),
        TransE(N, R, D, p_norm=2, reciprocal=True, init_std=0.5),
        DistMult(N, R, D, reciprocal=False, init_std=0.5),
        DistMult(N, R, D, reciprocal=True, init_std=0.5),
    ]


@pytest.mark.parametrize("model", models(), ids=["transe-l1", "transe-l2-reciprocal", "distmult", "distmult-reciprocal"])
@pytest.mark.parametrize("side", ["tail", "head"])
def test_candidate_scores_equal_triple_scores(model, side):
    """Scoring a query against a candidate set = scoring each (query, candidate) triple."""
    model.double()
    anchors, relations = torch.tensor([0, 5, 7]), torch.tensor([1, 3, 0])
    candidates = torch.arange(N)
    w = model.node_emb.weight
    batched = model.score_candidates(w[anchors], relations, w[candidates], side)
    for i, (a, r) in enumerate(zip(anchors, relations)):
        for e in candidates:
            h, t = (a, e) if side == "tail" else (e, a)
            if side == "head" and model.reciprocal:  # asked as (t, r^-1, ?)
                expected = model(t[None], (r + R)[None], h[None])
            else:
                expected = model(h[None], r[None], t[None])
            assert batched[i, e].item() == pytest.approx(expected.item(), rel=1e-9, abs=1e-9)


def test_score_definitions_by_hand():
    transe = TransE(3, 1, 2, p_norm=1, reciprocal=False)
    distmult = DistMult(3, 1, 2, reciprocal=False)
    for m in (transe, distmult):
        with torch.no_grad():
            m.node_emb.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.0, 0.0]]))
            m.rel_emb.weight.copy_(torch.tensor([[0.5, 1.0]]))
    h, r, t = torch.tensor([0]), torch.tensor([0]), torch.tensor([1])
    assert transe(h, r, t).item() == pytest.approx(-(abs(1 + 0.5 - 3) + abs(2 + 1 + 1)))  # -||h + r - t||_1
    assert distmult(h, r, t).item() == pytest.approx(1 * 0.5 * 3 + 2 * 1.0 * -1)  # <h, r, t>
    assert distmult(t, r, h).item() == distmult(h, r, t).item()  # symmetric


def test_cross_entropy_is_softmax_over_answer_and_unmasked_negatives():
    positive = torch.tensor([2.0, 0.5])
    negative = torch.tensor([[1.0, 3.0, -1.0], [0.0, 0.5, 9.0]])
    masked = torch.tensor([[False, True, False], [False, False, True]])
    loss = ranking_loss("cross_entropy", positive, negative, masked)
    expected = (-F.log_softmax(torch.tensor([2.0, 1.0, -1.0]), 0)[0] - F.log_softmax(torch.tensor([0.5, 0.0, 0.5]), 0)[0]) / 2
    assert loss.item() == pytest.approx(expected.item())


def test_softplus_and_margin_by_hand():
    positive, negative = torch.tensor([1.0]), torch.tensor([[0.0, 2.0, 5.0]])
    masked = torch.tensor([[False, False, True]])
    softplus = ranking_loss("softplus", positive, negative, masked)
    assert softplus.item() == pytest.approx((F.softplus(torch.tensor(-1.0)) + (F.softplus(torch.tensor(0.0)) + F.softplus(torch.tensor(2.0))) / 2).item())
    margin = ranking_loss("margin", positive, negative, masked, margin=1.5)
    assert margin.item() == pytest.approx((max(0, 1.5 - 1 + 0) + max(0, 1.5 - 1 + 2)) / 2)


def test_gradients_are_sparse():
    model = TransE(N, R, D)
    model.embed(torch.tensor([1, 2])).sum().backward()
    assert model.node_emb.weight.grad.is_sparse
