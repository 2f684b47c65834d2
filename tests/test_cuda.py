"""CUDA parameters: moments stay on the host, only touched rows cross the bus.

Skipped without a CUDA device (CI has none); run on a GPU machine with ``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dsa_train import DiskSparseAdam

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("maximize", [False, True])
def test_cuda_parity_with_sparse_adam(state_dir, maximize):
    model = nn.Embedding(500, 16, sparse=True).cuda()
    ours_model = copy.deepcopy(model)
    reference = torch.optim.SparseAdam(model.parameters(), lr=0.01, maximize=maximize)
    with DiskSparseAdam(ours_model.parameters(), lr=0.01, maximize=maximize, state_dir=state_dir) as ours:
        for t in range(200):
            g = torch.Generator().manual_seed(t)
            idx = torch.randint(0, 500, (256,), generator=g).cuda()
            target = torch.randn(256, 16, generator=g).cuda()
            for m, opt in ((model, reference), (ours_model, ours)):
                opt.zero_grad()
                (m(idx) * target).sum().backward()
                opt.step()
        assert ours_model.weight.device.type == "cuda"
        assert ours._store.files["param0"].moments.device.type == "cpu"
        torch.testing.assert_close(ours_model.weight, model.weight, rtol=0, atol=1e-5)


def test_cuda_memory_does_not_grow_with_the_table(state_dir):
    n, d, lookups = 2_000_000, 64, 8192  # SparseAdam would add 2 x 512 MB of moments
    emb = nn.Embedding(n, d, sparse=True).cuda()
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir) as opt:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for t in range(5):
            opt.zero_grad()
            idx = torch.randint(0, n, (lookups,), device="cuda")
            emb(idx).pow(2).sum().backward()
            opt.step()
        torch.cuda.synchronize()
        opt.zero_grad()
        grown = torch.cuda.max_memory_allocated() - before
    # gradient rows, coalesced copy and updates: a few times lookups x d x 4 bytes
    assert grown < 16 * lookups * d * 4, f"GPU memory grew by {grown / 2**20:.1f} MiB"
