"""Filtered ranking against a brute-force reference that scores one triple at a time."""

from __future__ import annotations

import pytest
import torch

from dsa_train.eval import TripleIndex
from dsa_train.eval.ranking import RankingMetrics, evaluate_link_prediction, query_ranks
from dsa_train.models import DistMult, TransE

N, R = 23, 3


def integer_model(kind, reciprocal, p_norm=2):
    """Embeddings in {-1, 0, 1}: every score is exact, and many tie."""
    model = (
        TransE(N, R, 4, p_norm=p_norm, reciprocal=reciprocal)
        if kind == "transe"
        else DistMult(N, R, 4, reciprocal=reciprocal)
    )
    model.double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.node_emb.weight.copy_(torch.randint(-1, 2, model.node_emb.weight.shape, generator=g).double())
        model.rel_emb.weight.copy_(torch.randint(-1, 2, model.rel_emb.weight.shape, generator=g).double())
    return model


def random_triples(count, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack(
        [
            torch.randint(0, N, (count,), generator=g),
            torch.randint(0, R, (count,), generator=g),
            torch.randint(0, N, (count,), generator=g),
        ],
        1,
    )


def brute_force_rank(model, h, r, t, side, known, candidates=range(N)):
    """Rank of the answer among ``candidates``, one triple score at a time, filtered by ``known``."""
    w = model.node_emb.weight
    anchor, answer = (h, t) if side == "tail" else (t, h)

    def score(e):
        rel, scored = model.query_relations(torch.tensor([r]), side)
        return model.answer_scores(w[[anchor]], rel, w[[e]], scored).item()

    true = score(answer)
    rivals = []
    for e in candidates:
        triple = (h, r, e) if side == "tail" else (e, r, t)
        if e != answer and triple not in known:
            rivals.append(score(e))
    return 1 + (sum(s > true for s in rivals) + sum(s >= true for s in rivals)) / 2


@pytest.mark.parametrize(
    "kind,reciprocal,p_norm", [("distmult", False, 2), ("distmult", True, 2), ("transe", False, 1), ("transe", True, 2)]
)
@pytest.mark.parametrize("entity_chunk", [N, 5])
def test_ranks_match_brute_force(kind, reciprocal, p_norm, entity_chunk):
    model = integer_model(kind, reciprocal, p_norm)
    train, test = random_triples(60, 2), random_triples(15, 3)
    everything = torch.cat([train, test])
    known = {tuple(t) for t in everything.tolist()}
    index = TripleIndex.from_triples(everything, N, R)
    for side in ("tail", "head"):
        anchor, answer = (test[:, 0], test[:, 2]) if side == "tail" else (test[:, 2], test[:, 0])
        ours = query_ranks(
            model.score_entities, anchor, test[:, 1], answer, side, index, num_entities=N, entity_chunk=entity_chunk
        )
        expected = [brute_force_rank(model, h, r, t, side, known) for h, r, t in test.tolist()]
        assert ours.tolist() == expected, side


def test_sampled_ranking_matches_brute_force_on_the_sample():
    model = integer_model("distmult", True)
    test = random_triples(12, 4)
    known = {tuple(t) for t in test.tolist()}
    index = TripleIndex.from_triples(test, N, R)
    sample = torch.tensor([0, 3, 3, 7, 11, 19, 22])
    ours = query_ranks(
        model.score_entities,
        test[:, 0],
        test[:, 1],
        test[:, 2],
        "tail",
        index,
        num_entities=N,
        entity_chunk=N,
        sampled=sample,
    )
    expected = [
        brute_force_rank(model, h, r, t, "tail", known, candidates=sorted(set(sample.tolist())))
        for h, r, t in test.tolist()
    ]
    assert ours.tolist() == expected


def test_filtering_removes_other_true_answers():
    # Every entity answers (0, 0, ?) truly: filtered, the answer has no rivals at all.
    triples = torch.stack([torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.long), torch.arange(N)], 1)
    model = integer_model("distmult", False)
    ranks = query_ranks(
        model.score_entities,
        triples[:, 0],
        triples[:, 1],
        triples[:, 2],
        "tail",
        TripleIndex.from_triples(triples, N, R),
        num_entities=N,
        entity_chunk=7,
    )
    assert torch.equal(ranks, torch.ones(N))


def test_ties_rank_realistically_and_nan_ranks_last():
    model = DistMult(N, R, 2, reciprocal=False)
    torch.nn.init.zeros_(model.node_emb.weight)  # every score is 0: all N - 1 rivals tie
    triple = torch.tensor([[1, 0, 2]])
    index = TripleIndex.from_triples(triple, N, R)
    rank = query_ranks(
        model.score_entities, triple[:, 0], triple[:, 1], triple[:, 2], "tail", index, num_entities=N, entity_chunk=N
    )
    assert rank.item() == 1 + (0 + (N - 1)) / 2
    with torch.no_grad():
        model.node_emb.weight.fill_(float("nan"))
    rank = query_ranks(
        model.score_entities, triple[:, 0], triple[:, 1], triple[:, 2], "tail", index, num_entities=N, entity_chunk=N
    )
    assert rank.item() == N


def test_metrics_from_ranks():
    m = RankingMetrics.of(torch.tensor([1.0, 2.0, 4.0, 20.0]))
    assert m.mr == pytest.approx(6.75)
    assert m.mrr == pytest.approx((1 + 0.5 + 0.25 + 0.05) / 4)
    assert (m.hits_at_1, m.hits_at_3, m.hits_at_10) == (0.25, 0.5, 0.75)


def test_evaluate_reports_both_sides():
    model = integer_model("transe", True)
    test = random_triples(10, 5)
    result = evaluate_link_prediction(
        model.score_entities, test, TripleIndex.from_triples(test, N, R), num_entities=N, batch_size=4, entity_chunk=6
    )
    assert result["tail"].queries == result["head"].queries == 10 and result["both"].queries == 20
    assert result["both"].mrr == pytest.approx((result["tail"].mrr + result["head"].mrr) / 2)


def test_evaluate_with_an_index_on_disk_matches_brute_force(tmp_path):
    from dsa_train.data.triple_index import write_triple_index

    model = integer_model("distmult", True)
    train, valid, test = random_triples(60, 6), random_triples(10, 7), random_triples(13, 8)
    splits = [t.numpy() for t in (train, valid, test, test[:4])]  # test[:4]: duplicates
    write_triple_index(tmp_path / "filter", lambda: splits, N, R, memory_bytes=4096)
    known = {tuple(t) for t in torch.cat([train, valid, test]).tolist()}
    result = evaluate_link_prediction(
        model.score_entities, test, TripleIndex.open(tmp_path / "filter"), num_entities=N, batch_size=5, entity_chunk=7
    )
    for side in ("tail", "head"):
        expected = RankingMetrics.of(
            torch.tensor([brute_force_rank(model, h, r, t, side, known) for h, r, t in test.tolist()])
        )
        assert result[side] == expected, side
