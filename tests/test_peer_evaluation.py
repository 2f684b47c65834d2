"""Our filtered ranking against PyKEEN's, on vectors both tools score alike.

``tests/fixtures/pykeen_eval.json`` was made by ``scripts/peers/make_eval_fixture.py`` in a
PyKEEN environment: a seeded 60-entity graph, random TransE (p = 1 and 2), DistMult (also with
integer vectors, so that many scores tie), ComplEx and RotatE vectors in our row layout, some
entity rows copies of others, and PyKEEN's ``RankBasedEvaluator`` metrics of the test split:
filtered against train + valid + test, realistic ranks, per side. The script checked that PyKEEN's
``score_hrt`` equals our formula on every triple before it ranked. Here the same vectors go into
our models (``reciprocal=False``: PyKEEN's models have one relation row for both sides) and
through the ranking ``dsa-train run`` and ``eval`` use.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsa_train.eval import TripleIndex
from dsa_train.eval.ranking import evaluate_link_prediction
from dsa_train.models import SCORING_FUNCTIONS

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "pykeen_eval.json").read_text())
TOLERANCE = 1e-4


def our_metrics(case: dict, entity_chunk: int = 65_536) -> dict[str, dict]:
    n, r = FIXTURE["num_entities"], FIXTURE["num_relations"]
    model = SCORING_FUNCTIONS.get(case["kind"])(n, r, case["dim"], reciprocal=False, **case["options"])
    with torch.no_grad():
        model.node_emb.weight.copy_(torch.tensor(case["entities"]))
        model.rel_emb.weight.copy_(torch.tensor(case["relations"]))
    model.eval()
    splits = {name: torch.tensor(rows) for name, rows in FIXTURE["splits"].items()}
    index = TripleIndex.from_triples(torch.cat(list(splits.values())), n, r)
    metrics = evaluate_link_prediction(
        model.score_entities, splits["test"], index, num_entities=n, batch_size=16, entity_chunk=entity_chunk
    )
    return {side: m.as_dict() for side, m in metrics.items()}


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
@pytest.mark.parametrize("entity_chunk", [65_536, 7])
def test_filtered_ranking_agrees_with_pykeen(case, entity_chunk):
    ours = our_metrics(case, entity_chunk)
    for side in ("tail", "head", "both"):
        for metric, expected in case["pykeen"][side].items():
            assert ours[side][metric] == pytest.approx(expected, abs=TOLERANCE), (side, metric)


def test_the_fixture_has_ties_and_every_kind():
    """The copied rows tie exactly, so realistic ranks (not optimistic or pessimistic) are checked."""
    assert {c["kind"] for c in FIXTURE["cases"]} == {"transe", "distmult", "complex", "rotate"}
    for case in FIXTURE["cases"]:
        for row, source in FIXTURE["duplicate_rows"].items():
            assert case["entities"][int(row)] == case["entities"][source]
