"""Relation dropout (``model.relation_dropout``): one mask per query, shared by its answer and
its candidates, in sampled, 1-vs-all and k-vs-all training; none in evaluation.

The reference is the undropped relation table itself: every relation row a score sees must be
that row with each coordinate either zeroed or scaled by ``1 / (1 - p)``, and the rows the
answer sees must be exactly the rows the candidates see.
"""

from __future__ import annotations

import pytest
import torch

from dsa_train.recipe import parse_recipe
from dsa_train.train.tasks import make_task

TINY = """\
name: tiny-reldrop
dataset:
  kind: synthetic
  synthetic: {entities: 200, relations: 5, triples: 2000, valid: 50, test: 50, clusters: 8, seed: 3}
model: {kind: complex, dim: 16, init_std: 0.1, dropout: 0.0, relation_dropout: 0.5}
train: {epochs: 1, batch_size: 64, negatives: 32, entity_chunk: 64}
optimizer: {kind: dsa, lr: 0.01}
eval: {every_epochs: 0, final_splits: []}
"""

P = 0.5


def spied_task(*overrides: str):
    """A task whose model records the relation rows each answer and candidate score gets."""
    torch.manual_seed(0)
    task = make_task(parse_recipe(TINY, overrides=list(overrides)), torch.device("cpu"))
    seen = {"answers": [], "candidates": []}
    model = task.model
    score_sets, answer_scores = model.score_sets, model.answer_scores

    def spy_sets(anchor, rel, candidates, side):
        seen["candidates"].append((rel.detach().clone(), side))
        return score_sets(anchor, rel, candidates, side)

    def spy_answers(anchor, rel, answer, side):
        seen["answers"].append((rel.detach().clone(), side))
        return answer_scores(anchor, rel, answer, side)

    def spy_both(anchor, rel, answer, candidates, side):  # a step scores both in one call
        return spy_answers(anchor, rel, answer, side), spy_sets(anchor, rel, candidates, side)

    model.score_sets, model.answer_scores, model.scores_with_answers = spy_sets, spy_answers, spy_both
    return task, seen


def undropped(task, batch) -> dict[str, torch.Tensor]:
    """Each side's relation rows without dropout, in the order the loss scores the queries."""
    model = task.model
    return {
        side: model.rel_emb(model.relation_for(batch.relations[rows], side)[0]).detach() for side, rows in batch.sides()
    }


def assert_dropped_from(rows: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
    """``rows`` is ``plain`` with coordinates zeroed or scaled by ``1 / (1 - p)``; returns which were zeroed."""
    zeroed = rows == 0
    torch.testing.assert_close(rows[~zeroed], plain[~zeroed] / (1 - P))
    return zeroed.flatten()


@pytest.mark.parametrize(
    "overrides",
    [(), ("train.candidates=all",), ("train.candidates=all", "train.labels=all")],
    ids=["sampled", "1-vs-all", "k-vs-all"],
)
def test_the_answer_and_the_candidates_share_one_mask_per_query(overrides):
    task, seen = spied_task(*overrides)
    picked = torch.arange(64)
    task.model.train()
    task.loss(picked).backward()
    batch = task.queries(picked)
    plain = undropped(task, batch)
    first = [rel for rel, _ in seen["candidates"][:2]]  # the first chunk: tail queries, then head queries
    zeroed = [assert_dropped_from(rel, plain[side]) for rel, (side, _) in zip(first, batch.sides())]
    # every later chunk sees the same rows: the mask is drawn once per step, not per chunk
    for i, (rel, _) in enumerate(seen["candidates"][2:]):
        assert torch.equal(rel, first[i % 2])
    if "train.labels=all" in overrides:  # answers come per label: the rows of the label's query
        tail_labels = int((batch.label_query < batch.tails).sum())
        every = torch.cat(first)
        expected = [every[batch.label_query[:tail_labels]], every[batch.label_query[tail_labels:]]]
    else:
        expected = first
    assert len(seen["answers"]) == 2
    for (rel, _), want in zip(seen["answers"], expected):
        assert torch.equal(rel, want)
    assert 0.3 < torch.cat(zeroed).float().mean() < 0.7  # p = 0.5 of hundreds of coordinates


def test_evaluation_scores_with_the_whole_relation_rows():
    task, _ = spied_task()
    model = task.model
    model.eval()
    relation = torch.tensor([0, 3, 4])
    for side in ("tail", "head"):
        rel, _ = model.query_relations(relation, side)
        assert torch.equal(rel, model.rel_emb(model.relation_for(relation, side)[0]))
    model.train()
    rel, _ = model.query_relations(relation, "tail")
    assert not torch.equal(rel, model.rel_emb(relation))  # and training does drop


def test_rotate_refuses_relation_dropout():
    from dsa_train.errors import ConfigError

    with pytest.raises(ConfigError, match="model.relation_dropout") as caught:
        parse_recipe(TINY, overrides=["model.kind=rotate"])
    assert "rotation angles" in str(caught.value) and "set it to 0" in str(caught.value)
