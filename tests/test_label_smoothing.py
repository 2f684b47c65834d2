"""``train.label_smoothing``: the cross-entropy's target keeps ``1 - eps`` on the answers and
spreads ``eps`` evenly over the candidates. References: torch's own
``F.cross_entropy(label_smoothing=...)`` where the candidates are its classes, and a case
worked out by hand where some negatives are masked."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dsa_train.errors import ConfigError
from dsa_train.models.losses import every_entity_loss, ranking_loss
from dsa_train.recipe import parse_recipe

EPS = 0.1


def test_sampled_cross_entropy_is_torchs_label_smoothing():
    g = torch.Generator().manual_seed(0)
    positive, negative = (
        torch.randn(6, generator=g, dtype=torch.float64),
        torch.randn(6, 9, generator=g, dtype=torch.float64),
    )
    none = torch.zeros(6, 9, dtype=torch.bool)
    logits = torch.cat([positive[:, None], negative], 1)
    expected = F.cross_entropy(logits, torch.zeros(6, dtype=torch.long), label_smoothing=EPS)
    torch.testing.assert_close(ranking_loss("cross_entropy", positive, negative, none, label_smoothing=EPS), expected)
    plain = ranking_loss("cross_entropy", positive, negative, none)
    assert not torch.isclose(plain, expected)  # the smoothing changed it
    assert torch.equal(plain, ranking_loss("cross_entropy", positive, negative, none, label_smoothing=0.0))


def test_masked_negatives_are_no_candidates_by_hand():
    positive = torch.tensor([2.0], dtype=torch.float64)
    negative = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64)
    masked = torch.tensor([[False, True, False]])  # the query's own answer among the negatives
    lse = math.log(math.exp(2) + math.exp(1) + math.exp(-1))
    by_hand = lse - (1 - EPS) * 2.0 - EPS * (2.0 + 1.0 - 1.0) / 3
    assert ranking_loss("cross_entropy", positive, negative, masked, label_smoothing=EPS).item() == pytest.approx(
        by_hand
    )
    total = ranking_loss("cross_entropy", positive, negative, masked, label_smoothing=EPS, total=4)
    assert total.item() == pytest.approx(by_hand / 4)


def _every_entity(scores: torch.Tensor, labels: list[tuple[int, int]], chunk: int) -> torch.Tensor:
    label_query = torch.tensor([q for q, _ in labels])
    label_entity = torch.tensor([e for _, e in labels])
    return every_entity_loss(
        "cross_entropy",
        lambda start, stop: scores[:, start:stop],
        scores[label_query, label_entity],
        label_query,
        label_entity,
        num_queries=scores.shape[0],
        num_entities=scores.shape[1],
        chunk=chunk,
        label_smoothing=EPS,
    )


@pytest.mark.parametrize("chunk", [50, 7])  # one chunk, and several (each recomputed in the backward pass)
def test_one_vs_all_is_torchs_label_smoothing_over_every_entity(chunk):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(5, 50, generator=g, dtype=torch.float64, requires_grad=True)
    answers = torch.tensor([3, 17, 49, 0, 22])
    loss = _every_entity(scores, list(enumerate(answers.tolist())), chunk)
    reference = F.cross_entropy(scores, answers, label_smoothing=EPS)
    torch.testing.assert_close(loss, reference)
    (grad,) = torch.autograd.grad(loss, scores)
    (expected,) = torch.autograd.grad(reference, scores)
    torch.testing.assert_close(grad, expected)


def test_k_vs_all_spreads_one_minus_eps_over_the_answers():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 20, generator=g, dtype=torch.float64)
    labels = [(0, 1), (0, 4), (0, 9), (1, 0), (2, 5), (2, 19)]
    target = torch.full((3, 20), EPS / 20, dtype=torch.float64)
    for q, answers in ((0, [1, 4, 9]), (1, [0]), (2, [5, 19])):
        target[q, answers] += (1 - EPS) / len(answers)
    reference = -(target * scores.log_softmax(1)).sum(1).mean()  # the cross-entropy against that target
    torch.testing.assert_close(_every_entity(scores, labels, 6), reference)


def test_a_recipe_smooths_only_the_cross_entropy():
    base = """\
name: smoothing
dataset: {kind: synthetic}
model: {kind: distmult, dim: 8}
train: {epochs: 1, label_smoothing: 0.1, loss: %s}
"""
    assert parse_recipe(base % "cross_entropy").train.label_smoothing == 0.1
    with pytest.raises(ConfigError, match="label_smoothing"):
        parse_recipe(base % "softplus")
    with pytest.raises(ConfigError, match=r"label_smoothing.*\[0, 1\)"):
        parse_recipe((base % "cross_entropy").replace("0.1", "1.0"))
