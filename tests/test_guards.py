"""What DiskSparseAdam refuses before writing anything: non-finite gradients, a full disk."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest
import torch
from torch import nn

from dsa_train import DiskSparseAdam, StateError, TrainingError
from dsa_train.storage import row_file


def files_hash(directory):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.name != ".lock"
    }


def step(emb, opt, rows, scale=1.0):
    opt.zero_grad()
    (emb(torch.tensor(rows)).sum() * scale).backward()
    opt.step()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_gradient_is_refused_before_any_write(state_dir, poison):
    users, items = nn.Embedding(10, 3, sparse=True), nn.Embedding(10, 3, sparse=True)
    params = [("users", users.weight), ("items", items.weight)]
    with DiskSparseAdam(params, state_dir=state_dir) as opt:
        step(users, opt, [1, 2])
        opt.flush()
        before = files_hash(state_dir), users.weight.detach().clone()
        opt.zero_grad()
        users(torch.tensor([3])).sum().backward()  # a clean gradient for users...
        (items(torch.tensor([4])).sum() * poison).backward()  # ...and a poisoned one for items
        with pytest.raises(
            TrainingError, match=r"parameter 'items' has a non-finite gradient \(NaN or Inf\) at its step 1"
        ):
            opt.step()
        assert files_hash(state_dir) == before[0]  # not even marked dirty
        assert torch.equal(users.weight, before[1]) and opt.state[users.weight]["step"] == 1


def test_non_finite_gradient_can_skip_the_step(state_dir):
    emb = nn.Embedding(10, 3, sparse=True)
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir, nonfinite="skip") as opt:
        step(emb, opt, [1])
        weights = emb.weight.detach().clone()
        step(emb, opt, [2], scale=float("nan"))
        assert opt.skipped_steps == 1 and torch.equal(emb.weight, weights) and opt.state[emb.weight]["step"] == 1
        step(emb, opt, [2])
        assert opt.state[emb.weight]["step"] == 2
    with pytest.raises(ValueError, match="Invalid nonfinite policy: 'ignore'"):
        DiskSparseAdam(emb.parameters(), state_dir=state_dir, nonfinite="ignore")


class FakeDisk:
    """A disk with ``free`` bytes, on which fallocate fails when asked for more."""

    def __init__(self, monkeypatch, free):
        self.free = free
        real = os.statvfs

        def statvfs(path):
            result = real(path)
            return os.statvfs_result((result.f_bsize, 1, result.f_blocks, self.free, self.free, *tuple(result)[5:]))

        def fallocate(fd, offset, length):
            if length > self.free:
                raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(row_file.os, "statvfs", statvfs)
        monkeypatch.setattr(row_file.os, "posix_fallocate", fallocate)


def test_full_disk_refuses_the_step_cleanly_and_recovers(state_dir, monkeypatch):
    emb = nn.Embedding(1000, 64, sparse=True)
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir) as opt:
        step(emb, opt, [1, 2])
        opt.flush()
        before = files_hash(state_dir), emb.weight.detach().clone()
        disk = FakeDisk(monkeypatch, free=1000)
        with pytest.raises(StateError, match="the disk is full: no room for the rows this step writes") as err:
            step(emb, opt, list(range(100, 200)))
        assert "the state is intact" in err.value.hint
        assert files_hash(state_dir) == before[0] and torch.equal(emb.weight, before[1])
        assert opt.state[emb.weight]["step"] == 1
        disk.free = 1 << 40  # space freed: training goes on
        step(emb, opt, list(range(100, 200)))
        assert opt.state[emb.weight]["step"] == 2


def test_near_full_disk_allocates_the_rows_it_writes(state_dir, monkeypatch):
    emb = nn.Embedding(100_000, 64, sparse=True)  # 51 MB of moments, sparse
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir) as opt:
        FakeDisk(monkeypatch, free=1 << 20)  # little room, but enough for the rows written
        monkeypatch.setattr(row_file.os, "posix_fallocate", os.posix_fallocate)
        step(emb, opt, [5, 70_000, 99_999])
        allocated = (state_dir / "param0.rows").stat().st_blocks * 512
        assert 3 * 512 <= allocated <= 64 << 10  # the rows' pages, not the 51 MB file
