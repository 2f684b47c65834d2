"""Score functions and losses: every code path agrees with the per-triple definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsa_train.models.kge import ComplEx, DistMult, RotatE, TransE
from dsa_train.models.losses import ranking_loss

N, R, D = 30, 4, 8


def models():
    return [
        TransE(N, R, D, p_norm=1, reciprocal=False, init_std=0.5),
        TransE(N, R, D, p_norm=2, reciprocal=True, init_std=0.5),
        DistMult(N, R, D, reciprocal=False, init_std=0.5),
        DistMult(N, R, D, reciprocal=True, init_std=0.5),
        ComplEx(N, R, D, reciprocal=False, init_std=0.5),
        ComplEx(N, R, D, reciprocal=True, init_std=0.5),
        RotatE(N, R, D, reciprocal=False, init_std=0.5, gamma=2.0),
        RotatE(N, R, D, reciprocal=True, init_std=0.5),
    ]


MODEL_IDS = ["transe-l1", "transe-l2-reciprocal", "distmult", "distmult-reciprocal", "complex", "complex-reciprocal", "rotate", "rotate-reciprocal"]


@pytest.mark.parametrize("model", models(), ids=MODEL_IDS)
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


def brute_force_complex(h, r, t):
    """Re(sum_i h_i r_i conj(t_i)) with Python's complex numbers, rows laid out [re | im]."""
    k = len(h) // 2
    c = lambda x, i: complex(float(x[i]), float(x[k + i]))  # noqa: E731
    return sum((c(h, i) * c(r, i) * c(t, i).conjugate()).real for i in range(k))


def brute_force_rotate(h, theta, t, gamma):
    """gamma - sqrt(sum_i |h_i e^(i theta_i) - t_i|^2) with Python's complex numbers."""
    import cmath
    import math

    k = len(h) // 2
    c = lambda x, i: complex(float(x[i]), float(x[k + i]))  # noqa: E731
    return gamma - math.sqrt(sum(abs(c(h, i) * cmath.exp(1j * float(theta[i])) - c(t, i)) ** 2 for i in range(k)))


@pytest.mark.parametrize("kind", ["complex", "rotate"])
def test_complex_scores_equal_a_brute_force_in_complex_numbers(kind):
    """Every path (one triple, a candidate set on either side) against the definition in
    Python's complex arithmetic: ComplEx's Re<h, r, conj(t)>, RotatE's gamma - ||h o r - t||."""
    torch.manual_seed(0)
    model = ComplEx(N, R, D, reciprocal=False, init_std=0.7) if kind == "complex" else RotatE(N, R, D, reciprocal=False, init_std=0.7, gamma=3.0)
    model.double()
    w, rel = model.node_emb.weight.detach(), model.rel_emb.weight.detach()
    assert rel.shape == ((R, D) if kind == "complex" else (R, D // 2))  # a rotation is dim / 2 phases
    truth = (lambda h, r, t: brute_force_complex(w[h], rel[r], w[t])) if kind == "complex" else (lambda h, r, t: brute_force_rotate(w[h], rel[r], w[t], 3.0))
    for h, r, t in [(0, 1, 2), (5, 3, 5), (29, 0, 11)]:
        assert model(torch.tensor([h]), torch.tensor([r]), torch.tensor([t])).item() == pytest.approx(truth(h, r, t), rel=1e-12)
    anchors, relations, candidates = torch.tensor([3, 8]), torch.tensor([2, 0]), torch.arange(N)
    for side in ("tail", "head"):
        batched = model.score_candidates(w[anchors], relations, w[candidates], side)
        for i, (a, r) in enumerate(zip(anchors.tolist(), relations.tolist())):
            for e in candidates.tolist():
                h, t = (a, e) if side == "tail" else (e, a)
                assert batched[i, e].item() == pytest.approx(truth(h, r, t), rel=1e-9, abs=1e-9)


def test_complex_models_match_pyg_on_the_same_numbers():
    """The scores are PyG's ComplEx and RotatE scores (its two tables copied into our [re | im] rows)."""
    from torch_geometric.nn.kge import ComplEx as PyGComplEx
    from torch_geometric.nn.kge import RotatE as PyGRotatE

    torch.manual_seed(1)
    h, r, t = torch.tensor([0, 4, 9]), torch.tensor([1, 0, 2]), torch.tensor([3, 4, 1])
    theirs = PyGComplEx(N, R, D // 2)
    ours = ComplEx(N, R, D, reciprocal=False)
    with torch.no_grad():
        ours.node_emb.weight.copy_(torch.cat([theirs.node_emb.weight, theirs.node_emb_im.weight], 1))
        ours.rel_emb.weight.copy_(torch.cat([theirs.rel_emb.weight, theirs.rel_emb_im.weight], 1))
    assert torch.allclose(ours(h, r, t), theirs(h, r, t), atol=1e-6)
    theirs = PyGRotatE(N, R, D // 2, margin=2.0)
    ours = RotatE(N, R, D, reciprocal=False, gamma=2.0)
    with torch.no_grad():
        ours.node_emb.weight.copy_(torch.cat([theirs.node_emb.weight, theirs.node_emb_im.weight], 1))
        ours.rel_emb.weight.copy_(theirs.rel_emb.weight)
    assert torch.allclose(ours(h, r, t), theirs(h, r, t), atol=1e-5)


def test_n3_of_complex_models_is_over_moduli():
    """N3 over the moduli of complex coordinates (Lacroix et al.); a rotation adds nothing."""
    entities = torch.tensor([[3.0, 0.0, 4.0, 1.0]])  # coordinates 3 + 4i and 0 + 1i: moduli 5 and 1
    relations = torch.tensor([[0.0, 2.0, 0.0, 0.0]])  # moduli 0 and 2
    assert ComplEx(2, 1, 4).n3(entities, relations).item() == pytest.approx(125 + 1 + 8)
    assert RotatE(2, 1, 4).n3(entities, torch.tensor([[0.3, 1.2]])).item() == pytest.approx(126)
    assert DistMult(2, 1, 4).n3(entities, relations).item() == pytest.approx(27 + 64 + 1 + 8)
    zero = torch.zeros(1, 4, requires_grad=True)  # a coordinate dropped out whole: |z|^3 has gradient 0 there, not NaN
    ComplEx(2, 1, 4).n3(zero, torch.zeros(1, 4)).backward()
    assert torch.equal(zero.grad, torch.zeros(1, 4))


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
