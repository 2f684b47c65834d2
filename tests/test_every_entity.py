"""Training against every entity: 1-vs-all and k-vs-all, scored a chunk of entities at a time.

References written out here: the distinct queries and their answers from a Python scan of the
triples, each loss from its per-query definition over the full score vector, and the
unchunked loss and gradients for every chunk size.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.data.kg_queries import DistinctQueries
from dsa_train.errors import ConfigError
from dsa_train.recipe import parse_recipe
from dsa_train.runs.run_folder import MetricsLog
from dsa_train.train.tasks import make_task

TINY = """\
name: tiny-all
dataset:
  kind: synthetic
  synthetic: {entities: 300, relations: 6, triples: 4000, valid: 100, test: 100, clusters: 10, seed: 1}
model: {kind: distmult, dim: 16, init_std: 0.05, dropout: 0.1}
train: {epochs: 3, batch_size: 128, candidates: all, log_every: 4, regularization: 0.001}
optimizer: {kind: dsa, lr: 0.01}
eval: {every_epochs: 0, final_splits: [test]}
"""


def answers_by_scan(triples: torch.Tensor) -> dict[tuple[str, int, int], set[int]]:
    """(side, anchor, relation) -> the answers, from one pass over the triples."""
    found = defaultdict(set)
    for h, r, t in triples.tolist():
        found["tail", h, r].add(t)
        found["head", t, r].add(h)
    return found


def test_distinct_queries_are_every_query_once_with_all_its_answers():
    triples = torch.tensor([[0, 0, 1], [0, 0, 2], [3, 1, 1], [0, 0, 1], [2, 0, 1], [4, 1, 0]])
    queries = DistinctQueries(triples, 5, 2)
    expected = answers_by_scan(triples)
    assert len(queries) == len(expected) == 8  # tail: (0,0) (3,1) (2,0) (4,1); head: (1,0) (2,0) (1,1) (0,1)
    batch = queries.batch(torch.randperm(len(queries)))
    seen = {}
    for i, (anchor, relation) in enumerate(zip(batch.anchors.tolist(), batch.relations.tolist())):
        side = "tail" if i < batch.tails else "head"
        seen[side, anchor, relation] = set(batch.label_entity[batch.label_query == i].tolist())
    assert seen == expected
    assert torch.equal(batch.label_query, torch.sort(batch.label_query).values)  # grouped by query, tails first


def task_for(*overrides: str):
    recipe = parse_recipe(TINY, overrides=["model.dropout=0", "train.regularization=0", *overrides])
    torch.manual_seed(0)
    task = make_task(recipe, torch.device("cpu"))
    task.model.double()
    return task


def every_score(task, side: str, anchor: int, relation: int) -> torch.Tensor:
    model, n = task.model, task.kg.num_entities
    every = torch.arange(n)
    if side == "tail":
        return model(torch.full((n,), anchor), torch.full((n,), relation), every)
    return model(every, torch.full((n,), relation), torch.full((n,), anchor))


@pytest.mark.parametrize("loss", ["cross_entropy", "softplus"])
@pytest.mark.parametrize("model", ["distmult", "complex", "transe"])
def test_k_vs_all_loss_is_its_definition_per_query(loss, model):
    """Each distinct query: cross-entropy of the softmax over every entity against the target
    spread over its answers, or the balanced binary cross-entropy."""
    task = task_for(
        "train.labels=all",
        f"train.loss={loss}",
        f"model.kind={model}",
        "train.entity_chunk=37",
        "model.reciprocal=false",
    )
    answers = answers_by_scan(task.kg.train.long())
    picked = torch.tensor([0, 5, 11, len(task.distinct_queries()) - 1, len(task.distinct_queries()) // 2 + 3])
    batch = task.distinct_queries().batch(picked)
    actual = task.loss(picked)
    expected = []
    with torch.no_grad():
        for i, (anchor, relation) in enumerate(zip(batch.anchors.tolist(), batch.relations.tolist())):
            side = "tail" if i < batch.tails else "head"
            scores = every_score(task, side, anchor, relation)
            labelled = torch.zeros(len(scores), dtype=torch.bool)
            labelled[sorted(answers[side, anchor, relation])] = True
            if loss == "cross_entropy":
                expected.append(-torch.log_softmax(scores, 0)[labelled].mean())
            else:
                expected.append(F.softplus(-scores[labelled]).mean() + F.softplus(scores[~labelled]).mean())
    assert actual.item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-9)


@pytest.mark.parametrize(
    "labels,loss",
    [("one", "cross_entropy"), ("one", "softplus"), ("one", "margin"), ("all", "cross_entropy"), ("all", "softplus")],
)
def test_chunks_change_nothing_but_how_many_scores_are_held(labels, loss, monkeypatch):
    """Any train.entity_chunk gives the unchunked loss and gradients, and no score matrix,
    forward or recomputed in the backward pass, is wider than a chunk."""
    widest = []
    results = {}
    for chunk in (300, 64, 7):
        task = task_for(
            f"train.labels={labels}",
            f"train.loss={loss}",
            f"train.entity_chunk={chunk}",
            "model.kind=complex",
            "train.regularization=0.01",
        )
        score_sets = task.model.score_sets

        def recording(anchor, rel, candidates, side, score_sets=score_sets):
            widest.append(len(candidates))
            return score_sets(anchor, rel, candidates, side)

        monkeypatch.setattr(task.model, "score_sets", recording)
        widest.clear()
        loss_value = task.loss(torch.arange(40, 80))
        loss_value.backward()
        assert max(widest) == min(chunk, 300)
        calls = 2 * -(-300 // chunk)  # a tail and a head group per chunk
        assert len(widest) == (
            calls if chunk >= 300 else 2 * calls
        )  # several chunks: each scored again in the backward pass
        grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in task.model.parameters()]
        results[chunk] = (loss_value.item(), grads)
    reference_loss, reference_grads = results[300]
    for chunk in (64, 7):
        assert results[chunk][0] == pytest.approx(reference_loss, rel=1e-12)
        for got, want in zip(results[chunk][1], reference_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_k_vs_all_epoch_is_the_distinct_queries_and_the_memory_check_counts_chunks():
    task = task_for("train.labels=all")
    assert task.epoch_items() == len(answers_by_scan(task.kg.train.long()))
    from dsa_train.train.kge import kge_working

    step = kge_working(parse_recipe(TINY, overrides=["train.entity_chunk=100"]), 3000, 100, 300)[0]
    assert "256 queries x 100 entities at a time" in step.what and "train.entity_chunk" in step.keys
    wide = kge_working(parse_recipe(TINY, overrides=["train.entity_chunk=100000", "train.labels=all"]), 3000, 100, 300)[
        0
    ]
    assert "128 queries x 300 entities at a time" in wide.what


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["train.labels=all", "train.candidates=sampled"], "train.labels"),
        (["train.labels=all", "train.loss=margin"], "train.loss"),
    ],
)
def test_k_vs_all_refuses_what_it_cannot_mean(overrides, key):
    with pytest.raises(ConfigError, match=key):
        parse_recipe(TINY, overrides=overrides)


def test_k_vs_all_trains_equally_with_both_optimizers(tmp_path):
    """A k-vs-all run from the CLI learns, and DiskSparseAdam's run equals SparseAdam's."""
    finals = {}
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    for optimizer in ("dsa", "sparse_adam"):
        out = tmp_path / optimizer
        result = CliRunner().invoke(
            app,
            [
                "run",
                str(path),
                "--output",
                str(out),
                "--set",
                "train.labels=all",
                "--set",
                "optimizer.lr=0.1",
                "--set",
                f"optimizer.kind={optimizer}",
            ],
        )
        assert result.exit_code == 0, result.stderr
        records = MetricsLog.read(out / "metrics.jsonl")
        summary = [r for r in records if r["kind"] == "summary"][0]
        assert {r["unit"] for r in records if r["kind"] == "epoch"} == {"queries"}  # an epoch item is a query
        finals[optimizer] = (
            [r["loss"] for r in records if r["kind"] == "train"],
            summary["final"]["test"]["both"]["mrr"],
        )
    assert len(finals["dsa"][0]) >= 3 and finals["dsa"][1] > 0.15  # 300 entities: a random ranking's MRR is about 0.02
    assert finals["dsa"][0] == pytest.approx(finals["sparse_adam"][0], rel=1e-5)
    assert finals["dsa"][1] == pytest.approx(finals["sparse_adam"][1], rel=1e-5)
