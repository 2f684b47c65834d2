"""The compiled kernel's build, cache and fallbacks."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn

from dsa_train import DiskSparseAdam
from dsa_train.optim import native


@pytest.fixture
def fresh_native(tmp_path, monkeypatch):
    """``native.load`` with an empty cache and its memo cleared (restored afterwards)."""
    monkeypatch.setenv("DSA_CACHE_DIR", str(tmp_path / "cache"))
    native.load.cache_clear()
    yield native
    native.load.cache_clear()


def test_kernel_builds_into_the_cache_and_passes_its_self_test(fresh_native, tmp_path):
    try:
        library = fresh_native.build()
    except Exception as e:
        pytest.skip(f"no C compiler here: {e}")
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
    if fresh_native.load() is None:
        pytest.skip("no C compiler here")
    fresh_native.load.cache_clear()
    monkeypatch.setattr(fresh_native.functional, "self_test", lambda kernel: "torch.float32, maximize=False")
    with pytest.warns(RuntimeWarning, match="disagrees with torch"):
        assert fresh_native.load() is None
