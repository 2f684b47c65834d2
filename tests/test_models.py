"""Score functions and losses: every code path agrees with the per-triple definition."""

from __future__ import annotations

import cmath
import math

import pytest
import torch
import torch.nn.functional as F

from dsa_train.models import SCORING_FUNCTIONS, ComplEx, DistMult, RotatE, TransE
from dsa_train.models.losses import ranking_loss

N, R, D = 30, 4, 8


class ScoringCase:
    """What every registered scoring function must do (PyKEEN's ``tests/cases.py`` pattern): a
    subclass per scoring function names it, gives the models to try, and computes its score
    from the published definition with Python floats, independently of the class."""

    kind: str
    models: list[dict] = [{"reciprocal": False}, {"reciprocal": True}]  # constructor options to try

    def truth(self, model, h: int, r: int, t: int) -> float:
        raise NotImplementedError

    def query_truth(self, model, side: str, anchor: int, r: int, e: int) -> float:
        """The definition's score of entity ``e`` answering the ``side`` query of ``anchor``
        and relation ``r``: a reciprocal model asks a head query (?, r, t) as (t, r^-1, ?)."""
        if side == "tail":
            return self.truth(model, anchor, r, e)
        if model.reciprocal:
            return self.truth(model, anchor, r + R, e)
        return self.truth(model, e, r, anchor)

    def build(self, options: dict):
        torch.manual_seed(0)
        return SCORING_FUNCTIONS.get(self.kind)(N, R, D, init_std=0.5, **options).double()

    def test_registered_under_its_name(self):
        assert SCORING_FUNCTIONS.get(self.kind).name == self.kind

    def test_triple_scores_equal_the_definition(self):
        for options in self.models:
            model = self.build(options)
            for h, r, t in [(0, 1, 2), (5, 3, 5), (29, 0, 11)]:
                got = model(torch.tensor([h]), torch.tensor([r]), torch.tensor([t])).item()
                assert got == pytest.approx(self.truth(model, h, r, t), rel=1e-9, abs=1e-12)

    @pytest.mark.parametrize("side", ["tail", "head"])
    def test_candidate_scores_equal_the_definition(self, side):
        """Scoring a query against a candidate set = each (query, candidate) triple by definition;
        a reciprocal model asks a head query (?, r, t) as (t, r^-1, ?)."""
        for options in self.models:
            model = self.build(options)
            anchors, relations, candidates = torch.tensor([0, 5, 7]), torch.tensor([1, 3, 0]), torch.arange(N)
            w = model.node_emb.weight
            batched = model.score_candidates(w[anchors], relations, w[candidates], side)
            for i, (a, r) in enumerate(zip(anchors.tolist(), relations.tolist())):
                for e in candidates.tolist():
                    expected = self.query_truth(model, side, a, r, e)
                    assert batched[i, e].item() == pytest.approx(expected, rel=1e-9, abs=1e-9)

    @pytest.mark.parametrize("side", ["tail", "head"])
    def test_scores_without_autograd_have_the_same_bits(self, side):
        """Evaluation and prediction score in place without autograd: the same bits as
        training's out-of-place scores, and the inputs left as they were."""
        for options in self.models:
            model = self.build(options).float()
            w = model.node_emb.weight
            anchors, relations = torch.tensor([0, 5, 7]), torch.tensor([1, 3, 0])
            tracked = model.score_candidates(w[anchors], relations, w, side)
            before = w.detach().clone()
            with torch.no_grad():
                untracked = model.score_candidates(w[anchors], relations, w, side)
            assert tracked.requires_grad and torch.equal(tracked.detach(), untracked)
            assert torch.equal(w.detach(), before)

    @pytest.mark.parametrize("side", ["tail", "head"])
    def test_ranking_keys_order_as_the_scores_and_give_them_back(self, side):
        """A top-k kept by key (prediction) is a top-k by score, with the scores' own bits."""
        for options in self.models:
            model = self.build(options).float()
            with torch.no_grad():
                w = model.node_emb.weight
                rel, scored = model.query_relations(torch.tensor([1, 3, 0]), side)
                scores = model.score_sets(w[[0, 5, 7]], rel, w, scored)
                keys = model.ranking_keys(w[[0, 5, 7]], rel, w, scored)
                by_key = scores.gather(1, keys.argsort(dim=1, descending=True, stable=True))
                assert (by_key[:, :-1] >= by_key[:, 1:]).all()
                assert torch.equal(model.scores_of_keys(keys.clone()), scores)

    @pytest.mark.parametrize("side", ["tail", "head"])
    def test_a_step_s_answers_and_candidates_scored_together_equal_the_definition(self, side):
        """Training scores a query's answer and the shared candidates in one call (sharing the
        query's work): the answer's score is the triple's by definition, the candidates' are
        ``score_sets``' bit for bit."""
        for options in self.models:
            model = self.build(options)
            w = model.node_emb.weight
            anchors, answers = torch.tensor([0, 5, 7]), torch.tensor([2, 5, 29])
            rel, scored = model.query_relations(torch.tensor([1, 3, 0]), side)
            positive, negative = model.scores_with_answers(w[anchors], rel, w[answers], w, scored)
            assert torch.equal(negative, model.score_sets(w[anchors], rel, w, scored))
            for i, (a, r, e) in enumerate(zip(anchors.tolist(), [1, 3, 0], answers.tolist())):
                expected = self.query_truth(model, side, a, r, e)
                assert positive[i].item() == pytest.approx(expected, rel=1e-9, abs=1e-9)

    def test_gradients_are_sparse(self):
        model = SCORING_FUNCTIONS.get(self.kind)(N, R, D)
        model.score_candidates(
            model.embed(torch.tensor([1, 2])), torch.tensor([0, 1]), model.embed(torch.arange(N)), "tail"
        ).sum().backward()
        assert model.node_emb.weight.grad.is_sparse and model.rel_emb.weight.grad.is_sparse

    def test_relation_width_is_the_table_s(self):
        assert SCORING_FUNCTIONS.get(self.kind)(N, R, D).rel_emb.weight.shape == (
            2 * R,
            SCORING_FUNCTIONS.get(self.kind).relation_width(D),
        )


def rows(model, h: int, r: int, t: int) -> tuple[list[float], list[float], list[float]]:
    w, rel = model.node_emb.weight.detach(), model.rel_emb.weight.detach()
    return w[h].tolist(), rel[r].tolist(), w[t].tolist()


def complex_numbers(x: list[float]) -> list[complex]:
    """A row laid out [re | im] as Python complex numbers."""
    k = len(x) // 2
    return [complex(x[i], x[k + i]) for i in range(k)]


class TestTransE(ScoringCase):
    kind = "transe"
    models = [{"p_norm": 1, "reciprocal": False}, {"p_norm": 2, "reciprocal": True}]

    def truth(self, model, h, r, t):
        eh, er, et = rows(model, h, r, t)
        return -(sum(abs(a + b - c) ** model.p_norm for a, b, c in zip(eh, er, et)) ** (1 / model.p_norm))


class TestDistMult(ScoringCase):
    kind = "distmult"

    def truth(self, model, h, r, t):
        return sum(a * b * c for a, b, c in zip(*rows(model, h, r, t)))


class TestComplEx(ScoringCase):
    kind = "complex"

    def truth(self, model, h, r, t):
        """Re(sum_i h_i r_i conj(t_i)) with Python's complex numbers."""
        eh, er, et = (complex_numbers(x) for x in rows(model, h, r, t))
        return sum((a * b * c.conjugate()).real for a, b, c in zip(eh, er, et))


class TestRotatE(ScoringCase):
    kind = "rotate"
    models = [{"reciprocal": False, "gamma": 3.0}, {"reciprocal": True}]

    def truth(self, model, h, r, t):
        """gamma - sqrt(sum_i |h_i e^(i theta_i) - t_i|^2) with Python's complex numbers."""
        eh, theta, et = rows(model, h, r, t)
        pairs = zip(complex_numbers(eh), theta, complex_numbers(et))
        return model.gamma - math.sqrt(sum(abs(a * cmath.exp(1j * b) - c) ** 2 for a, b, c in pairs))


class TestSimplE(ScoringCase):
    kind = "simple"

    def truth(self, model, h, r, t):
        """(<h_h, v_r, t_t> + <h_t, v_r^-1, t_h>) / 2 (Kazemi and Poole 2018, eq. 2), rows [head role | tail role], [v_r | v_r^-1]."""
        (eh, er, et), k = rows(model, h, r, t), D // 2
        cp = lambda a, b, c: sum(x * y * z for x, y, z in zip(a, b, c))  # noqa: E731
        return (cp(eh[:k], er[:k], et[k:]) + cp(et[:k], er[k:], eh[k:])) / 2

    def test_a_score_by_hand(self):
        model = SCORING_FUNCTIONS.get(self.kind)(2, 1, 4, reciprocal=False)
        with torch.no_grad():
            model.node_emb.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, -1.0], [0.5, -2.0, 4.0, 1.0]]))  # [h_e | t_e]
            model.rel_emb.weight.copy_(torch.tensor([[2.0, 1.0, -1.0, 3.0]]))  # [v_r | v_r^-1]
        # <h_0, v_r, t_1> = 1*2*4 + 2*1*1 = 10; <h_1, v_r^-1, t_0> = 0.5*-1*3 + -2*3*-1 = 4.5
        assert model(torch.tensor([0]), torch.tensor([0]), torch.tensor([1])).item() == pytest.approx((10 + 4.5) / 2)


def test_every_registered_scoring_function_has_a_test_case():
    """A scoring function registered without a ScoringCase here fails this (PyKEEN's meta-test)."""
    tested = {case.kind for case in ScoringCase.__subclasses__()}
    assert tested == set(SCORING_FUNCTIONS.names()), f"untested: {set(SCORING_FUNCTIONS.names()) - tested}"


def test_the_recipe_reads_what_each_scoring_function_declares_without_importing_it():
    """The recipe's checks read the declarations from source (no torch while validating): they
    must be what the imported classes say, for every registered function, in the same order."""
    from dsa_train.recipe.schema import scoring_functions

    declared = scoring_functions()
    assert list(declared) == list(SCORING_FUNCTIONS.names())
    for cls in SCORING_FUNCTIONS:
        for key in ("halves", "relation_dropout_unsupported"):
            assert declared[cls.name].get(key) == getattr(cls, key), (cls.name, key)


def test_an_unknown_scoring_function_is_an_error_naming_the_known_ones():
    from dsa_train.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"model.kind: 'transf' is not a known knowledge-graph scoring function \(known: 'transe', 'distmult', .*did you mean 'transe'",
    ):
        SCORING_FUNCTIONS.get("transf")


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
    expected = (
        -F.log_softmax(torch.tensor([2.0, 1.0, -1.0]), 0)[0] - F.log_softmax(torch.tensor([0.5, 0.0, 0.5]), 0)[0]
    ) / 2
    assert loss.item() == pytest.approx(expected.item())


def test_softplus_and_margin_by_hand():
    positive, negative = torch.tensor([1.0]), torch.tensor([[0.0, 2.0, 5.0]])
    masked = torch.tensor([[False, False, True]])
    softplus = ranking_loss("softplus", positive, negative, masked)
    assert softplus.item() == pytest.approx(
        (F.softplus(torch.tensor(-1.0)) + (F.softplus(torch.tensor(0.0)) + F.softplus(torch.tensor(2.0))) / 2).item()
    )
    margin = ranking_loss("margin", positive, negative, masked, margin=1.5)
    assert margin.item() == pytest.approx((max(0, 1.5 - 1 + 0) + max(0, 1.5 - 1 + 2)) / 2)
