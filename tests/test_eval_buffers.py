"""An evaluation reuses its score matrix and comparison flags instead of allocating a batch's
``(B, K)`` matrices again for every batch (which let glibc's heap grow an FB15k-237 run from
about 300 MB to 1-2 GB; docs/peers.md section 6).

References: ``query @ candidates.T`` and the model's own ``score_entities`` (the same bits), the
brute-force ranks of tests/test_ranking.py, and torch's profiler for what a batch allocates.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dsa_train.data.triple_index import TripleIndex
from dsa_train.eval.ranking import evaluate_link_prediction
from dsa_train.models import SCORING_FUNCTIONS
from dsa_train.models.kge import product

E, R, DIM, B = 1_500, 7, 16, 64


def model_of(kind: str, normalize: bool = False):
    torch.manual_seed(0)
    options = {"p_norm": 2} if kind == "transe" else {}
    model = SCORING_FUNCTIONS.get(kind)(E, R, DIM, init_std=0.5, normalize_entities=normalize, **options)
    return model.eval()


def test_product_writes_the_same_bits_into_the_buffer():
    g = torch.Generator().manual_seed(0)
    query, candidates = torch.randn(5, 8, generator=g), torch.randn(11, 8, generator=g)
    out = torch.full((5, 11), float("nan"))
    got = product(query, candidates, out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, query @ candidates.T)
    # a buffer that does not fit, or autograd, gets a new matrix
    assert product(query, candidates, torch.empty(5, 12)).data_ptr() != out.data_ptr()
    leaf = query.clone().requires_grad_()
    assert product(leaf, candidates, out).requires_grad


@pytest.mark.parametrize("kind", sorted(SCORING_FUNCTIONS.names()))
@pytest.mark.parametrize("normalize", [False, True])
def test_entity_scorer_reuses_rows_and_buffer_with_the_same_scores(kind, normalize):
    model = model_of(kind, normalize)
    scorer = model.entity_scorer()
    gathered = []
    entities = model.entities
    model.entities = lambda ids: gathered.append(len(ids)) or entities(ids)
    g = torch.Generator().manual_seed(1)
    anchor, relation = torch.randint(0, E, (B,), generator=g), torch.randint(0, R, (B,), generator=g)
    chunks = [torch.arange(0, 700), torch.arange(0, 700), torch.arange(700, E)]  # a repeat, then new ids
    with torch.no_grad():
        for side in ("tail", "head"):
            for chunk in chunks:
                out = torch.empty(B, len(chunk))
                before = len(gathered)
                want = model.score_entities(anchor, relation, chunk, side)
                del gathered[before:]  # the reference's own gathers
                got = scorer(anchor, relation, chunk, side, out=out)
                assert torch.equal(got, want), (kind, side)
                if kind != "transe" or model.p_norm == 2:
                    assert got.data_ptr() == out.data_ptr()
    # candidate rows: the repeated chunk's were kept (2 gathers a side, not 3)
    assert [n for n in gathered if n > B] == [700, 800, 700, 800]


def kg_triples(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack(
        [
            torch.randint(0, E, (count,), generator=g),
            torch.randint(0, R, (count,), generator=g),
            torch.randint(0, E, (count,), generator=g),
        ],
        1,
    )


def large_allocations(fn, size: int) -> int:
    """How many times an operator allocated ``size`` bytes or more while ``fn`` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(1 for e in prof.events() if e.self_cpu_memory_usage >= size)


@pytest.mark.parametrize("kind", ["distmult", "rotate"])
def test_a_batch_allocates_no_score_matrix_once_the_buffers_exist(kind):
    model = model_of(kind)
    train, test = kg_triples(5_000, 2), kg_triples(4 * B, 3)
    index = TripleIndex.from_triples(torch.cat([train, test]), E, R)
    scorer = model.entity_scorer()
    calls = []

    def score(anchor, relation, candidates, side, *, out=None):
        calls.append(out.data_ptr())
        return scorer(anchor, relation, candidates, side, out=out)

    def evaluate():
        return evaluate_link_prediction(score, test, index, num_entities=E, batch_size=B)

    plain = evaluate_link_prediction(model.score_entities, test, index, num_entities=E, batch_size=B)
    assert {s: m.as_dict() for s, m in evaluate().items()} == {s: m.as_dict() for s, m in plain.items()}
    assert len(set(calls)) == 1, "every batch and side is offered the same buffer"
    matrix = B * E * 4
    # Two matrices per evaluation (the score buffer and the flags), whatever its number of
    # batches (8 here); before the buffers every batch allocated its own: the scores, their
    # NaN-free copy, two comparisons' flags and each cast to int64 to be summed.
    calls.clear()
    assert large_allocations(evaluate, matrix // 2) == 2
    assert len(calls) == 8
