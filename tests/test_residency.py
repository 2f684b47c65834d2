"""The memory budget: changed rows stay in memory between flushes, leave past the budget
(written once each), and the results never differ from torch.optim.SparseAdam's."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dsa_train import DiskEmbedding, DiskSparseAdam
from dsa_train.errors import ConfigError, StateError
from dsa_train.optim import disk_sparse_adam
from dsa_train.storage import residency
from dsa_train.storage.format import HEADER_BYTES
from dsa_train.storage.residency import PAGE, resolve_budget
from dsa_train.recipe import load_recipe

from .helpers import pagemap_hidden

pytestmark = pytest.mark.skipif(pagemap_hidden() is not None, reason=str(pagemap_hidden()))

N, D, LOOKUPS = 6000, 16, 400


def grads(seed: int, steps: int, rows: int = N, dim: int = D):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(0, rows, (LOOKUPS,), generator=g)
        yield torch.sparse_coo_tensor(
            index[None], torch.randn(LOOKUPS, dim, generator=g), (rows, dim), check_invariants=False
        )


@pytest.mark.parametrize("budget", [0, 3 * PAGE, 40 * PAGE, None])
def test_any_budget_is_sparse_adam_bit_for_bit(tmp_path, budget):
    """Weights and moments after every step, across a flush and a reopen, whatever leaves memory."""
    ours = torch.nn.Parameter(torch.randn(N, D))
    theirs = torch.nn.Parameter(ours.detach().clone())
    reference = torch.optim.SparseAdam([theirs], lr=1e-2)
    opt = DiskSparseAdam([("w", ours)], lr=1e-2, state_dir=tmp_path / "s", memory_budget=budget)
    for i, grad in enumerate(grads(1, 30)):
        for p in (ours, theirs):
            p.grad = grad
        reference.step()
        opt.step()
        assert torch.equal(ours, theirs), i
        if budget is not None:
            assert opt.residency()["resident_bytes"] <= max(budget, 0)
        if i == 12:
            opt.close()
            opt = DiskSparseAdam([("w", ours)], lr=1e-2, state_dir=tmp_path / "s", memory_budget=budget)
    moments = opt._store.files["w"]
    assert torch.equal(moments.m, reference.state[theirs]["exp_avg"])
    assert torch.equal(moments.v, reference.state[theirs]["exp_avg_sq"])
    opt.close()


def _file_moments(path, rows: int, dim: int) -> torch.Tensor:
    """The ``(rows, 2, dim)`` m|v records as the file on disk holds them (read, not mapped)."""
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        raw = f.read(rows * 2 * dim * 4)
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(rows, 2, dim)


def test_nothing_reaches_the_file_between_flushes_within_the_budget(tmp_path):
    w = torch.nn.Parameter(torch.randn(N, D))
    opt = DiskSparseAdam([("w", w)], lr=1e-2, state_dir=tmp_path / "s", memory_budget="1GiB")
    path = tmp_path / "s" / "w.rows"
    for grad in grads(2, 5):
        w.grad = grad
        opt.step()
    assert not _file_moments(path, N, D).any()  # the kernel wrote nothing back: the file is as created
    assert opt.residency()["resident_bytes"] > 0
    opt.flush()
    on_disk = _file_moments(path, N, D)
    assert torch.equal(on_disk, opt._store.files["w"].moments)
    assert opt.residency()["resident_bytes"] == 0  # written once, the copies dropped
    opt.close()


def test_past_the_budget_pages_leave_memory_written_once(tmp_path):
    w = torch.nn.Parameter(torch.randn(N, D))
    budget = 8 * PAGE
    opt = DiskSparseAdam([("w", w)], lr=1e-2, state_dir=tmp_path / "s", memory_budget=budget)
    residency = opt._store.files["w"].residency
    for grad in grads(3, 10):
        w.grad = grad
        opt.step()
        assert residency.resident_bytes() <= budget
    stats = residency.stats
    assert stats["evicted_bytes"] > 0
    assert stats["written_bytes"] <= stats["evicted_bytes"]  # each page that left was written once, no more
    # What left memory is on the file; what stayed is in memory: together, the optimizer's moments.
    opt.flush()
    assert torch.equal(_file_moments(tmp_path / "s" / "w.rows", N, D), opt._store.files["w"].moments)
    opt.close()


def test_a_write_through_the_mapping_outside_a_step_reaches_the_file(tmp_path):
    """Found by the kernel's page tables, not by the optimizer's marks: nothing is lost."""
    emb = DiskEmbedding(N, D, path=tmp_path / "table", seed=0)
    opt = DiskSparseAdam([("emb", emb.weight)], lr=1e-2, state_dir=tmp_path / "s")
    with torch.no_grad():
        emb.weight[17] = 42.0
        emb.weight[N - 1] = -1.0
    opt.close()
    emb.table.close()
    again = DiskEmbedding(N, D, path=tmp_path / "table")
    assert torch.equal(again.weight[17], torch.full((D,), 42.0))
    assert torch.equal(again.weight[N - 1], torch.full((D,), -1.0))
    again.table.close()


def test_disk_table_under_a_small_budget_is_sparse_adam(tmp_path):
    emb = DiskEmbedding(N, D, path=tmp_path / "table", seed=0)
    theirs = torch.nn.Parameter(emb.weight.detach().clone())
    reference = torch.optim.SparseAdam([theirs], lr=1e-2)
    opt = DiskSparseAdam([("emb", emb.weight)], lr=1e-2, state_dir=tmp_path / "s", memory_budget=5 * PAGE)
    for grad in grads(4, 12):
        emb.weight.grad = grad
        theirs.grad = grad
        opt.step()
        reference.step()
    assert torch.equal(emb.weight, theirs)
    opt.close()
    emb.table.close()
    again = DiskEmbedding(N, D, path=tmp_path / "table")
    assert torch.equal(again.weight, theirs)
    again.table.close()


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("2GiB", 2 << 30),
        ("512MB", 512 * 10**6),
        ("64 KiB", 64 << 10),
        ("1.5GiB", 3 << 29),
        ("100", 100),
    ],
)
def test_budget_sizes(given, expected):
    assert resolve_budget(given) == expected


@pytest.mark.parametrize("given", [-1, "lots", "2 parsecs", "150%", "-5%", 1.5, True, "%"])
def test_budget_refused(given):
    with pytest.raises(ValueError, match="Invalid memory_budget"):
        resolve_budget(given)


def test_share_of_free_memory_is_split_among_local_ranks(monkeypatch):
    monkeypatch.setattr("dsa_train.storage.residency.host_available_bytes", lambda: 8 << 30)
    assert resolve_budget("50%") == 4 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_budget("50%") == 1 << 30
    assert resolve_budget(None) == (8 << 30) * 3 // 4 // 4


def test_recipe_key():
    recipe = Path(__file__).parents[1] / "recipes" / "quickstart.yaml"
    assert load_recipe(recipe, ["optimizer.memory_budget=2GiB"]).optimizer.memory_budget == "2GiB"
    assert load_recipe(recipe, ["optimizer.memory_budget=0"]).optimizer.memory_budget == 0  # bytes: write out at once
    for wrong in ("lots", "-1", "true"):
        with pytest.raises(ConfigError, match="optimizer.memory_budget"):
            load_recipe(recipe, [f"optimizer.memory_budget={wrong}"])
    with pytest.raises(ConfigError, match="memory_budget"):
        load_recipe(recipe, ["optimizer.kind=sparse_adam", "optimizer.memory_budget=1GiB"])


def test_file_on_disk_untouched_by_a_killed_writer(tmp_path):
    """A writer killed between flushes leaves the file as the last flush wrote it (the kernel
    never wrote the changed pages back), so the files are never a torn mix of two steps'
    pages beyond what the manifest already calls unclean."""
    script = f"""
import os, signal, torch
from dsa_train import DiskSparseAdam
w = torch.nn.Parameter(torch.zeros({N}, {D}))
opt = DiskSparseAdam([("w", w)], lr=1e-2, state_dir={str(tmp_path / "s")!r})
w.grad = torch.sparse_coo_tensor(torch.arange(100)[None], torch.ones(100, {D}), ({N}, {D}))
opt.step(); opt.flush()
w.grad = torch.sparse_coo_tensor(torch.arange(200, 300)[None], torch.ones(100, {D}), ({N}, {D}))
opt.step()
print("stepped", opt.state[w]["step"], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]  # killed, not ended by an error
    assert child.stdout.split() == ["stepped", "2"]  # and killed after the unflushed step
    on_disk = _file_moments(tmp_path / "s" / "w.rows", N, D)
    assert on_disk[:100].any(dim=(1, 2)).all()  # the flushed step is there
    assert not on_disk[100:].any()  # the step after it never reached the file


def test_a_full_disk_while_rows_leave_memory_is_named_and_loses_nothing(tmp_path, monkeypatch):
    """ENOSPC from an eviction's write: a StateError, the rows stay in memory, and once the
    disk has room again training goes on to SparseAdam's exact result."""
    ours = torch.nn.Parameter(torch.randn(N, D))
    theirs = torch.nn.Parameter(ours.detach().clone())
    reference = torch.optim.SparseAdam([theirs], lr=1e-2)
    opt = DiskSparseAdam([("w", ours)], lr=1e-2, state_dir=tmp_path / "s", memory_budget=4 * PAGE)
    real_pwrite, full = residency.os.pwrite, [True]

    def pwrite(fd, data, offset):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(residency.os, "pwrite", pwrite)
    refused = 0
    for i, grad in enumerate(grads(5, 12)):
        for p in (ours, theirs):
            p.grad = grad
        reference.step()
        if i < 6:
            with pytest.raises(StateError, match="could not write rows leaving memory") as err:
                opt.step()
            assert "No space left" in str(err.value) and "flush() writes them" in err.value.hint
            refused += 1
        else:
            full[0] = False  # room again
            opt.step()
        assert torch.equal(ours, theirs), i  # every step was complete, refused eviction or not
    assert refused == 6
    opt.close()
    assert_reopened_moments_are(tmp_path / "s", ours, reference.state[theirs])


@pytest.mark.parametrize("budget", [None, 400 * PAGE])
def test_short_memory_sends_changed_rows_out_whatever_the_budget(tmp_path, monkeypatch, budget):
    """Free memory below its floor: the step writes that much of its changed pages out (with a
    warning, once) and the results stay SparseAdam's."""
    ours = torch.nn.Parameter(torch.randn(N, D))
    theirs = torch.nn.Parameter(ours.detach().clone())
    reference = torch.optim.SparseAdam([theirs], lr=1e-2)
    opt = DiskSparseAdam([("w", ours)], lr=1e-2, state_dir=tmp_path / "s", memory_budget=budget)
    short = [0]
    monkeypatch.setattr(disk_sparse_adam, "memory_shortfall", lambda: short[0])
    monkeypatch.setattr(disk_sparse_adam, "PRESSURE_CHECK_SECONDS", 0.0)
    steps = iter(grads(6, 8))

    def step():
        grad = next(steps)
        for p in (ours, theirs):
            p.grad = grad
        reference.step()
        opt.step()
        assert torch.equal(ours, theirs)

    for _ in range(3):
        step()
    held = opt.residency()["resident_bytes"]
    assert held > 100 * PAGE
    short[0] = 50 * PAGE
    pages = -(-opt._store.files["w"].spec.file_bytes // PAGE)
    with pytest.warns(UserWarning, match="memory is short .* wrote .* out of memory early"):
        step()
    after = opt.residency()
    assert after["evicted_bytes"] >= 50 * PAGE
    assert after["resident_bytes"] <= (pages - 50) * PAGE  # whatever the step brought in, 50 pages left
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        step()
        assert opt.residency()["evicted_bytes"] >= 100 * PAGE
        short[0] = 0
        step()
    opt.close()
    assert_reopened_moments_are(tmp_path / "s", ours, reference.state[theirs])


def assert_reopened_moments_are(state_dir, param, expected: dict) -> None:
    """The state directory, reopened, holds SparseAdam's ``exp_avg`` and ``exp_avg_sq``."""
    reopened = DiskSparseAdam([("w", param)], lr=1e-2, state_dir=state_dir)
    moments = reopened._store.files["w"]
    assert torch.equal(moments.m, expected["exp_avg"])
    assert torch.equal(moments.v, expected["exp_avg_sq"])
    reopened.close()


def test_a_steps_writes_never_take_the_moments_past_the_budget(tmp_path, monkeypatch):
    """The budget bounds what the moments hold in memory during a step too, not only after it:
    the pages a step is about to write are counted before the first write, and colder pages
    leave first. Read from the kernel's page tables just after the writes, before the step
    ends (when the budget was only enforced after a step, a step overshot it by its own pages:
    238 MiB for 65,536 rows of 128)."""
    from dsa_train.storage.row_file import RowFile

    peaks = []
    original = RowFile.settle

    def settle(self):
        peaks.append(self.residency.changed_bytes())
        return original(self)

    monkeypatch.setattr(RowFile, "settle", settle)
    w = torch.nn.Parameter(torch.randn(N, D))
    budget = 60 * PAGE  # a step's 40 lookups touch at most 40 of the file's 190 pages
    opt = DiskSparseAdam([("w", w)], lr=1e-2, state_dir=tmp_path / "s", memory_budget=budget)
    g = torch.Generator().manual_seed(4)
    for _ in range(30):
        index = torch.randint(0, N, (40,), generator=g)
        w.grad = torch.sparse_coo_tensor(index[None], torch.randn(40, D, generator=g), (N, D))
        opt.step()
    assert opt._store.files["w"].residency.stats["evicted_bytes"] > 0  # the budget was reached
    assert max(peaks) <= budget, [p // PAGE for p in peaks]
    opt.close()
