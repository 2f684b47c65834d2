"""OGB's protocol (dsa_train.eval.ogb_protocol) against what ogb's own Evaluator computed.

tests/fixtures/ogb_evaluator.json was written by scripts/peers/ogb_evaluator_fixture.py in a
virtual environment holding ogb 1.3.6 (the version is in the file): random scores, with ties,
an answer equal to all its negatives, -inf and NaN.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_train.eval.ogb_protocol import OgbMetrics, evaluate_ogb, ogb_ranks

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "ogb_evaluator.json").read_text())
CASES = sorted(FIXTURE["cases"])


def test_fixture_is_ogbs():
    assert FIXTURE["ogb_version"] == "1.3.6"
    assert {"continuous", "ties", "all_equal", "nan_inf"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_ranks_match_ogbs_evaluator(case):
    data = FIXTURE["cases"][case]
    dtype = torch.float32 if data["dtype"] == "float32" else torch.float64
    pos, neg = torch.tensor(data["y_pred_pos"], dtype=dtype), torch.tensor(data["y_pred_neg"], dtype=dtype)
    ranks = ogb_ranks(pos, neg)
    ogb = data["ogb"]
    np.testing.assert_allclose((1.0 / ranks.float()).numpy(), ogb["mrr_list"], rtol=0, atol=1e-6)
    metrics = OgbMetrics.of(ranks)
    assert metrics.mrr == pytest.approx(ogb["mrr"], abs=1e-6)
    assert metrics.hits_at_1 == pytest.approx(ogb["hits@1"], abs=1e-6)
    assert metrics.hits_at_3 == pytest.approx(ogb["hits@3"], abs=1e-6)
    assert metrics.hits_at_10 == pytest.approx(ogb["hits@10"], abs=1e-6)
    assert metrics.queries == len(pos)


def test_ties_count_half_and_nan_answer_ranks_first():
    ranks = ogb_ranks(
        torch.tensor([1.0, 1.0, float("nan")]), torch.tensor([[1.0, 1.0, 0.0], [2.0, 1.0, 1.0], [5.0, 6.0, 7.0]])
    )
    assert ranks.tolist() == [2.0, 3.0, 1.0]  # 1 + (0 + 2) / 2; 1 + (1 + 3) / 2; NaN compares false


def test_evaluate_ogb_ranks_each_side_against_its_own_negatives():
    """A scorer that is the candidate id itself: the answer's rank is known by hand."""
    triples = torch.tensor([[5, 0, 2], [1, 0, 9]])
    head_neg = np.array([[1, 2, 6], [0, 3, 1]])  # query 0: 5 is beaten by 6 only; query 1: 1 by 3, ties 1
    tail_neg = np.array([[3, 3, 1], [9, 9, 9]])  # query 0: 2 beaten by 3, 3; query 1: 9 ties three times
    seen = []

    def score_each(anchor, relation, candidates, side):
        seen.append((side, anchor.tolist(), candidates[:, 0].tolist()))
        return candidates.double()

    metrics = evaluate_ogb(score_each, triples, head_neg, tail_neg, batch_size=1)
    ranks = [2.0, 2.5, 3.0, 2.5]  # head queries, then tail queries
    assert metrics.mrr == pytest.approx(float(np.mean([1 / r for r in ranks])), abs=1e-7)
    assert metrics.hits_at_1 == 0.0 and metrics.hits_at_3 == 1.0 and metrics.queries == 4
    assert seen == [("head", [2], [5]), ("head", [9], [1]), ("tail", [5], [2]), ("tail", [1], [9])]


def test_negatives_of_another_split_are_refused():
    with pytest.raises(ValueError, match="must be the split's own"):
        evaluate_ogb(lambda *a: None, torch.zeros((3, 3), dtype=torch.long), np.zeros((2, 4)), np.zeros((3, 4)))
