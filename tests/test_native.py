"""The compiled kernel's build, cache and fallbacks."""

from __future__ import annotations

import ctypes
import warnings

import pytest
import torch
from torch import nn

from dsa_train import DiskSparseAdam
from dsa_train.optim import native

from .helpers import file_system_of, fused_kernel


@pytest.fixture
def fresh_native(tmp_path, monkeypatch):
    """``native.load`` with an empty cache and its memo cleared (restored afterwards)."""
    monkeypatch.setenv("DSA_CACHE_DIR", str(tmp_path / "cache"))
    native.load.cache_clear()
    yield native
    native.load.cache_clear()


def test_kernel_builds_into_the_cache_and_passes_its_self_test(fresh_native, tmp_path):
    fused_kernel()  # a skip only where no C compiler exists; a failed build with one fails here
    library = fresh_native.build()
    assert library.parent == tmp_path / "cache" / "kernels"
    kernel = fresh_native.RowKernel(ctypes.CDLL(str(library)))
    assert fresh_native.functional.self_test(kernel) == ""
    assert fresh_native.load() is not None
    assert fresh_native.build() == library  # cached: not built again


def test_without_a_compiler_it_warns_and_falls_back(fresh_native, monkeypatch, state_dir):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning, match="could not build its fused kernel.*Install a C compiler"):
        assert fresh_native.load() is None
    emb = nn.Embedding(10, 3, sparse=True)
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir) as opt:  # still trains
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
        assert opt.state[emb.weight]["step"] == 1


def test_disabled_by_environment(fresh_native, monkeypatch):
    monkeypatch.setenv("DSA_NATIVE", "0")
    assert fresh_native.load() is None


def test_a_kernel_that_rounds_differently_is_refused(fresh_native, monkeypatch):
    fused_kernel()
    fresh_native.load.cache_clear()
    monkeypatch.setattr(fresh_native.functional, "self_test", lambda kernel: "torch.float32, maximize=False")
    with pytest.warns(RuntimeWarning, match="disagrees with torch"):
        assert fresh_native.load() is None


@pytest.fixture
def kernel():
    return fused_kernel()


def test_claiming_rows_for_writing_never_loses_a_concurrent_update(kernel):
    """A prefetch thread claims the pages of rows the step is writing at that very moment:
    the claim is an atomic write of nothing, so every one of the step's additions survives
    (a read-then-write-back prefetch would lose some of them)."""
    import threading

    records = torch.zeros(64, 3, 8)  # 96-byte records, many to a page
    rows = torch.arange(0, 64, 2)
    done = threading.Event()

    def claim_again_and_again():
        while not done.is_set():
            kernel.touch_rows(records.data_ptr(), rows, 96, 96, 4096, True)

    claimer = threading.Thread(target=claim_again_and_again)
    claimer.start()
    try:
        for _ in range(3000):
            records[rows] += 1.0
    finally:
        done.set()
        claimer.join()
    assert torch.equal(records[rows], torch.full((len(rows), 3, 8), 3000.0))
    assert torch.equal(records[1::2], torch.zeros(32, 3, 8))


@pytest.mark.parametrize("claim", [False, True])
def test_touching_a_fresh_files_rows_reads_or_claims_their_pages(kernel, tmp_path, claim):
    """Touching rows of a sparse file leaves every byte as it was; claiming them dirties just
    their pages (written back by a flush: the file then owns blocks there), reading does not."""
    import mmap
    import os

    page = mmap.PAGESIZE
    path = tmp_path / "rows"
    with open(path, "wb") as f:
        f.truncate(256 * page)
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 256 * page)
        records = torch.frombuffer(mapping, dtype=torch.uint8).view(512, page // 2)  # two records a page
        rows = torch.tensor([3, 100, 101, 400])  # pages 1, 50, 200
        kernel.touch_rows(records.data_ptr(), rows, page // 2, page // 2, page, claim)
        assert int(records.sum()) == 0
        del records
        mapping.flush()
        mapping.close()
    allocated = os.stat(path).st_blocks * 512
    if claim:
        assert allocated >= 3 * page
    elif file_system_of(path) not in (
        "tmpfs",
        "ramfs",
    ):  # (these allocate memory for pages only read: huge pages, even the whole file)
        assert allocated == 0  # clean zero pages are not written


def test_one_mismatch_that_does_not_repeat_keeps_the_kernel(fresh_native, monkeypatch):
    """A kernel that computes other bits fails every try; one failed try among passes (seen once
    in a prefetch thread under load) does not turn the fast path off for the process."""
    fused_kernel()
    fresh_native.load.cache_clear()
    tries = iter(["torch.float32, maximize=False", ""])
    monkeypatch.setattr(fresh_native.functional, "self_test", lambda kernel: next(tries))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh_native.load() is not None
