"""Shared fixtures: a fresh state directory per test and a fixed seed."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def state_dir(tmp_path):
    return tmp_path / "opt_state"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _data_root(tmp_path_factory, monkeypatch):
    """Datasets are imported under the data root: a fresh one per test, never ./datasets."""
    monkeypatch.setenv("DSA_DATA_ROOT", str(tmp_path_factory.mktemp("data_root")))


@pytest.fixture(params=["fused", "torch"])
def row_path(request, monkeypatch):
    """Run a test with the compiled kernel and again with the pure-torch update."""
    from dsa_train.optim import native

    if request.param == "torch":
        monkeypatch.setattr(native, "load", lambda: None)
    elif native.load() is None:
        try:
            native.build()
        except Exception as e:  # no compiler: nothing to test on this machine
            pytest.skip(f"the fused kernel cannot be built here: {e}")
        pytest.fail("the fused kernel builds but failed its self-test against the torch path")
    return request.param


@pytest.fixture
def test_data():
    """The folder of real datasets (``DSA_TEST_DATA``), or a skip saying how to get it."""
    import os
    from pathlib import Path

    root = os.environ.get("DSA_TEST_DATA")
    if not root or not Path(root).is_dir():
        pytest.skip("set DSA_TEST_DATA to a folder with FB15k-237/, WN18RR/, umls/, nations/ (../shared/datasets in CI)")
    return Path(root)


def copy_dataset(test_data, name, target):
    """Copy a read-only dataset folder where PyG may write its processed files."""
    import shutil

    shutil.copytree(test_data / name, target / name)
    for path in (target / name).rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target
