"""``model.normalize_entities``: every score sees entity rows scaled to unit L2 norm (the TransE
paper's constraint), in training and in evaluation, while the stored rows stay the optimizer's.

References: a TransE score worked out by hand on unit vectors, and the invariance it implies
(scaling a stored row by any positive factor changes no score and no loss).
"""

from __future__ import annotations

import math

import pytest
import torch

from dsa_train.models import DistMult, TransE
from dsa_train.recipe import parse_recipe
from dsa_train.train.tasks import make_task

TINY = """\
name: tiny-normalized
dataset:
  kind: synthetic
  synthetic: {entities: 200, relations: 5, triples: 2000, valid: 50, test: 50, clusters: 8, seed: 3}
model: {kind: transe, dim: 16, init_std: 0.3, dropout: 0.0, normalize_entities: true}
train: {epochs: 1, batch_size: 64, negatives: 32}
optimizer: {kind: dsa, lr: 0.01}
eval: {every_epochs: 0, final_splits: []}
"""


def test_transe_scores_unit_entity_rows_by_hand():
    model = TransE(3, 1, 2, p_norm=1, reciprocal=False, normalize_entities=True)
    with torch.no_grad():
        model.node_emb.weight.copy_(torch.tensor([[3.0, 4.0], [0.0, -2.0], [1.0, 1.0]]))
        model.rel_emb.weight.copy_(torch.tensor([[0.5, 1.0]]))
    h, r, t = torch.tensor([0]), torch.tensor([0]), torch.tensor([1])
    # h / |h| = (0.6, 0.8), t / |t| = (0, -1): -(|0.6 + 0.5 - 0| + |0.8 + 1 + 1|)
    assert model(h, r, t).item() == pytest.approx(-(1.1 + 2.8))
    scores = model.score_entities(h, r, torch.arange(3), "tail")
    expected = [
        -(abs(0.6 + 0.5 - c[0]) + abs(0.8 + 1 - c[1]))
        for c in ((0.6, 0.8), (0.0, -1.0), (1 / math.sqrt(2), 1 / math.sqrt(2)))
    ]
    torch.testing.assert_close(scores[0], torch.tensor(expected))


@pytest.mark.parametrize("cls", [TransE, DistMult])
def test_scaling_a_stored_row_changes_no_score(cls):
    model = cls(20, 3, 8, reciprocal=True, init_std=0.5, normalize_entities=True).double()
    anchors, relations, candidates = torch.tensor([1, 4, 9]), torch.tensor([0, 2, 1]), torch.arange(20)
    before = {side: model.score_entities(anchors, relations, candidates, side) for side in ("tail", "head")}
    with torch.no_grad():
        model.node_emb.weight.mul_(torch.rand(20, 1, dtype=torch.float64) * 5 + 0.1)
    for side in ("tail", "head"):
        torch.testing.assert_close(model.score_entities(anchors, relations, candidates, side), before[side])
    plain = cls(20, 3, 8, reciprocal=True, init_std=0.5).double()
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(
        plain.score_entities(anchors, relations, candidates, "tail"), before["tail"]
    )  # it is the constraint


@pytest.mark.parametrize("candidates", ["sampled", "all"])
def test_training_loss_ignores_the_stored_rows_scale(candidates):
    recipe = parse_recipe(TINY, overrides=[f"train.candidates={candidates}"])
    torch.manual_seed(0)
    task = make_task(recipe, torch.device("cpu"))
    task.model.double().train()
    picked = torch.arange(64)
    torch.manual_seed(1)
    loss = task.loss(picked).item()
    with torch.no_grad():
        task.model.node_emb.weight.mul_(3.0)
    torch.manual_seed(1)
    assert task.loss(picked).item() == pytest.approx(loss, rel=1e-12)
