"""``train.query_chunk``: a step's queries scored a slice at a time against sampled candidates,
each slice's gradient taken as it is scored. The reference is the same step unsliced: the
same loss and gradients (to float64 rounding), while no score matrix is taller than a slice
and none is made twice."""

from __future__ import annotations

import pytest
import torch

from dsa_train.errors import ConfigError
from dsa_train.recipe import parse_recipe
from dsa_train.train.kge import kge_working, query_chunk
from dsa_train.train.tasks import make_task

TINY = """\
name: tiny-sliced
dataset:
  kind: synthetic
  synthetic: {entities: 300, relations: 6, triples: 4000, valid: 100, test: 100, clusters: 10, seed: 1}
model: {kind: transe, dim: 16, init_std: 0.05}
train: {epochs: 1, batch_size: 40, negatives: 50}
optimizer: {kind: dsa, lr: 0.01}
eval: {every_epochs: 0, final_splits: [test]}
"""


def step(*overrides: str, monkeypatch) -> tuple[float, list[torch.Tensor], list[int]]:
    """One step's loss, its gradients, and the heights of the score matrices it made."""
    recipe = parse_recipe(TINY, overrides=list(overrides))
    torch.manual_seed(0)
    task = make_task(recipe, torch.device("cpu"))
    task.model.double()
    heights = []
    scores_with_answers = task.model.scores_with_answers  # a step's score matrices come from it

    def recording(anchor, rel, answer, candidates, side):
        heights.append(len(anchor))
        return scores_with_answers(anchor, rel, answer, candidates, side)

    monkeypatch.setattr(task.model, "scores_with_answers", recording)
    torch.manual_seed(1)  # the step's negatives
    loss = task.loss(torch.arange(40, 80))
    loss.backward()
    return loss.item(), [p.grad.to_dense() for p in task.model.parameters()], heights


@pytest.mark.parametrize("loss", ["cross_entropy", "softplus", "margin"])
@pytest.mark.parametrize("kind", ["transe", "complex"])
def test_slices_change_nothing_but_how_many_scores_are_held(loss, kind, monkeypatch):
    whole_loss, whole_grads, whole_heights = step(f"train.loss={loss}", f"model.kind={kind}", monkeypatch=monkeypatch)
    assert whole_heights == [40, 40]  # a tail and a head side, each scored once
    for chunk in (7, 40):
        sliced_loss, sliced_grads, heights = step(
            f"train.loss={loss}", f"model.kind={kind}", f"train.query_chunk={chunk}", monkeypatch=monkeypatch
        )
        assert max(heights) == min(chunk, 40)
        slices = 2 * -(-40 // chunk)
        assert len(heights) == slices  # each slice scored once: nothing recomputed in the backward pass
        assert sliced_loss == pytest.approx(whole_loss, rel=1e-12)
        for got, want in zip(sliced_grads, whole_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_by_default_a_step_is_sliced_by_its_sizes(monkeypatch):
    whole_loss, whole_grads, _ = step("train.query_chunk=80", monkeypatch=monkeypatch)
    monkeypatch.setattr("dsa_train.train.kge.SLICE_SCORES", 1300)  # 1,300 // (50 + 80 candidates) = 10 queries
    loss, grads, heights = step(monkeypatch=monkeypatch)
    assert heights == [10] * 8
    assert loss == pytest.approx(whole_loss, rel=1e-12)
    for got, want in zip(grads, whole_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_a_slice_as_large_as_the_step_is_the_unsliced_step_bit_for_bit(monkeypatch):
    whole = step(monkeypatch=monkeypatch)
    same = step("train.query_chunk=80", monkeypatch=monkeypatch)
    assert whole[0] == same[0] and all(torch.equal(a, b) for a, b in zip(whole[1], same[1])) and same[2] == [40, 40]


def test_the_memory_estimate_counts_a_slice_and_the_hint_names_it():
    def working(*overrides: str):
        recipe = parse_recipe(TINY, overrides=["train.batch_size=2048", "train.negatives=4096", *overrides])
        return kge_working(recipe, 100_000, 100, 5_000_000)[0]

    whole, sliced, default = working("train.query_chunk=4096"), working("train.query_chunk=1024"), working()
    scores = 4 * 8 * 8192  # bytes of 8 score matrices per query against 4096 + 4096 candidates
    assert whole.bytes - sliced.bytes == scores * (4096 - 1024)
    assert sliced.bytes - default.bytes == scores * (1024 - 256)  # by default 2,097,152 scores: 256 queries
    assert "train.query_chunk" in whole.hint and "train.query_chunk=1024" in sliced.keys
    assert "(4,096 queries x 8,192 candidates, 1,024 queries at a time)" in sliced.what
    assert "256 queries at a time" in default.what and "train.query_chunk (default)" in default.keys
    assert "queries at a time" not in whole.what


def test_the_default_slice_follows_the_sizes_alone():
    recipe = parse_recipe(TINY)
    assert [query_chunk(recipe.train, k) for k in (8192, 5120, 1 << 22, 1 << 30)] == [256, 409, 1, 1]
    assert query_chunk(parse_recipe(TINY, overrides=["train.query_chunk=7"]).train, 8192) == 7


def test_slices_apply_to_sampled_candidates_only():
    with pytest.raises(ConfigError, match="train.query_chunk"):
        parse_recipe(TINY, overrides=["train.candidates=all", "train.query_chunk=64"])
    with pytest.raises(ConfigError, match="query_chunk"):
        parse_recipe(TINY, overrides=["train.query_chunk=0"])
