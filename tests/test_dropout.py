"""The fast CPU dropout against torch's own: the same output, gradient and generator state,
so recipes train bit for bit as they did with ``F.dropout``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsa_train.models.dropout import dropout


def run(fn, x, p, training, seed):
    torch.manual_seed(seed)
    leaf = x.clone().requires_grad_(True)
    out = fn(leaf, p, training)
    (out * torch.arange(out.numel(), dtype=x.dtype).reshape(out.shape)).sum().backward()
    return out.detach(), leaf.grad, torch.rand(3)  # the last: where the generator was left


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.23, 0.5, 0.9])
@pytest.mark.parametrize("shape", [(5, 7), (300, 64), (2, 3, 4)])
def test_bit_for_bit_torchs_dropout(shape, p, dtype):
    x = torch.randn(shape, dtype=dtype)
    ours, theirs = run(dropout, x, p, True, 11), run(F.dropout, x, p, True, 11)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    kept = (ours[0] != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 0.2 if x.numel() < 100 else abs(kept - (1 - p)) < 0.03  # a mask that drops p of them
    assert torch.allclose(ours[0][ours[0] != 0], (x / (1 - p))[ours[0] != 0])


@pytest.mark.parametrize("p, training", [(0.0, True), (0.5, False), (1.0, True)])
def test_what_drops_nothing_or_everything_is_torchs(p, training):
    x = torch.randn(40, 8)
    for a, b in zip(run(dropout, x, p, training, 5), run(F.dropout, x, p, training, 5)):
        assert torch.equal(a, b)
