"""The row update alone, against hand-computed values and a dense reference."""

from __future__ import annotations

import math

import pytest
import torch

from dsa_train.optim.functional import AdamStep, Workspace, coalesce_rows, sparse_adam_rows_


def run_update(moments, grad, params, **hyper):
    def add(begin, rows, update):
        params.index_add_(0, rows, update)

    defaults = dict(step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, maximize=False)
    sparse_adam_rows_(moments, *coalesce_rows(grad), add, AdamStep(**{**defaults, **hyper}), Workspace())


def test_first_step_by_hand():
    # One row touched twice: g = 2 + 4 = 6. Step 1 from zero moments:
    # m = 0.1 * 6 = 0.6, v = 0.001 * 36 = 0.036,
    # theta -= 0.1 * sqrt(1 - 0.999) / (1 - 0.9) * 0.6 / (sqrt(0.036) + 1e-8)
    moments = torch.zeros(3, 2, 1, dtype=torch.float64)
    params = torch.ones(3, 1, dtype=torch.float64)
    grad = torch.sparse_coo_tensor([[1, 1]], torch.tensor([[2.0], [4.0]], dtype=torch.float64), (3, 1))
    run_update(moments, grad, params)
    assert moments[1, 0, 0].item() == pytest.approx(0.6, rel=1e-12)
    assert moments[1, 1, 0].item() == pytest.approx(0.036, rel=1e-12)
    step = 0.1 * math.sqrt(0.001) / 0.1 * 0.6 / (math.sqrt(0.036) + 1e-8)
    assert params[1, 0].item() == pytest.approx(1 - step, rel=1e-12)
    # untouched rows keep zero moments and their weights
    assert moments[[0, 2]].abs().sum() == 0 and torch.equal(params[[0, 2]], torch.ones(2, 1, dtype=torch.float64))


def test_second_step_and_maximize_by_hand():
    moments = torch.tensor([[[0.5], [0.25]]], dtype=torch.float64)  # m = 0.5, v = 0.25
    params = torch.zeros(1, 1, dtype=torch.float64)
    grad = torch.sparse_coo_tensor([[0]], torch.tensor([[1.0]], dtype=torch.float64), (1, 1))
    run_update(moments, grad, params, step=2, maximize=True, lr=0.01, beta1=0.5, beta2=0.75, eps=0.1)
    # g = -1: m = 0.5 + 0.5 * (-1 - 0.5) = -0.25, v = 0.25 + 0.25 * (1 - 0.25) = 0.4375
    m, v = -0.25, 0.4375
    assert moments[0, 0, 0].item() == pytest.approx(m) and moments[0, 1, 0].item() == pytest.approx(v)
    expected = -0.01 * math.sqrt(1 - 0.75**2) / (1 - 0.5**2) * m / (math.sqrt(v) + 0.1)
    assert params[0, 0].item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("lookups", [7, 5000])
def test_coalesced_rows_sum_to_the_dense_gradient(lookups):
    rows = torch.randint(0, 50, (lookups,))
    values = torch.randn(lookups, 3, dtype=torch.float64)
    unique, summed = coalesce_rows(torch.sparse_coo_tensor(rows[None], values, (50, 3)))
    dense = torch.zeros(50, 3, dtype=torch.float64).index_add_(0, rows, values)
    assert torch.equal(unique, torch.unique(rows))
    torch.testing.assert_close(summed, dense[unique], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_rows,lookups", [(2_000_000, 65_536), (1000, 65_536), (10, 300_000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_coalesced_rows_are_bitwise_coalesce(num_rows, lookups, dtype):
    rows = torch.randint(0, num_rows, (lookups,))
    grad = torch.sparse_coo_tensor(rows[None], torch.randn(lookups, 4).to(dtype), (num_rows, 4))
    reference = grad.coalesce()
    unique, summed = coalesce_rows(grad)
    assert torch.equal(unique, reference._indices()[0])
    assert torch.equal(summed, reference._values())
