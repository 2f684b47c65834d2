"""Where ``/proc/self/pagemap`` cannot be read (some containers) the row files are mapped shared
and the kernel writes changed rows back on its own (README, docs/performance.md "Fallback"):
training is still torch.optim.SparseAdam bit for bit, a step's rows reach the file without a
flush, and a checkpoint (a base, then a delta) restores bit for bit. These tests force that
fallback on any kernel, so they run here whether or not this machine hides pagemap."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from dsa_train import DiskSparseAdam
from dsa_train.storage import residency, row_file
from dsa_train.storage.format import HEADER_BYTES
from dsa_train.storage.residency import pagemap_readable

from .helpers import pagemap_hidden

N, D, LOOKUPS = 3000, 8, 200


@pytest.fixture
def shared(monkeypatch):
    """Row files opened now are mapped as where pagemap is hidden."""
    monkeypatch.setattr(row_file, "pagemap_readable", lambda: False)


def grads(seed: int, steps: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(0, N, (LOOKUPS,), generator=g)
        yield torch.sparse_coo_tensor(index[None], torch.randn(LOOKUPS, D, generator=g), (N, D))


def file_moments(path) -> torch.Tensor:
    """The m|v records as a read of the file gives them (the page cache, not our mapping)."""
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        raw = f.read(N * 2 * D * 4)
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(N, 2, D)


def test_pagemap_readable_says_what_the_kernel_does():
    """The product's probe agrees with a plain read of the file, and says False where the
    file cannot be opened (as in a container that hides it)."""
    assert pagemap_readable() == (pagemap_hidden() is None)

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    pagemap_readable.cache_clear()  # (it asks the kernel once a process)
    try:
        with mock.patch.object(residency.os, "open", refused):
            assert pagemap_readable() is False
    finally:
        pagemap_readable.cache_clear()
    assert pagemap_readable() == (pagemap_hidden() is None)


def test_the_shared_fallback_is_sparse_adam_and_writes_through(tmp_path, shared):
    ours = torch.nn.Parameter(torch.randn(N, D))
    theirs = torch.nn.Parameter(ours.detach().clone())
    reference = torch.optim.SparseAdam([theirs], lr=1e-2)
    opt = DiskSparseAdam([("w", ours)], lr=1e-2, state_dir=tmp_path / "s", memory_budget=0)
    assert opt._store.files["w"].residency is None  # the kernel's write-back, no budget of ours
    for i, grad in enumerate(grads(1, 20)):
        for p in (ours, theirs):
            p.grad = grad
        reference.step()
        opt.step()
        assert torch.equal(ours, theirs), i
        if i == 9:
            opt.close()
            opt = DiskSparseAdam([("w", ours)], lr=1e-2, state_dir=tmp_path / "s", memory_budget=0)
    expected = torch.stack([reference.state[theirs]["exp_avg"], reference.state[theirs]["exp_avg_sq"]], dim=1)
    # no flush: a shared mapping's stores are the file's pages, so a read sees them now
    assert torch.equal(file_moments(tmp_path / "s" / "w.rows"), expected)
    assert opt.residency()["resident_bytes"] == 0
    opt.close()


def test_the_shared_fallback_checkpoints_and_restores_bit_for_bit(tmp_path, shared):
    from .test_checkpoint_deltas import Parts, kinds, restored

    parts = Parts(tmp_path / "tables", tmp_path / "state")
    try:
        assert all(f.residency is None for f in parts.opt._store.files.values())
        checkpoints = tmp_path / "checkpoints"
        parts.train(0, 3)
        first = parts.save(checkpoints, 3)
        parts.train(3, 3)
        second = parts.save(checkpoints, 6)
        assert set(kinds(first).values()) == {"base"} and set(kinds(second).values()) == {"delta"}
        live = parts.files()
        assert restored(second, tmp_path / "back", parts.opt.state_id) == live
        assert restored(first, tmp_path / "back1", parts.opt.state_id) != live  # (the comparison can fail)
    finally:
        parts.close()
