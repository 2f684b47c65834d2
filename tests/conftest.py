"""Shared fixtures: a fresh state directory per test and a fixed seed; the ``slow`` marker.

``python -m pytest -q`` runs the fast tests; ``--run-slow`` adds those marked
``@pytest.mark.slow`` (multi-process training, benchmark smoke tests, kill-and-resume torture,
long hypothesis searches), as ``.ci/run`` does."""

from __future__ import annotations

import logging

import pytest
import torch

from .helpers import fused_kernel


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (the whole suite, as CI does)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds on 2 cores; skipped unless --run-slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --run-slow to run it (.ci/run does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def notes():
    """The messages the library logs (INFO and up, on the ``dsa_train`` logger) while the test
    runs, as they come: what ``dsa-train`` prints on stderr."""

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    kept: list[str] = []
    library, handler = logging.getLogger("dsa_train"), Kept(logging.INFO)
    level = library.level
    library.addHandler(handler)
    library.setLevel(logging.INFO)
    yield kept
    library.removeHandler(handler)
    library.setLevel(level)


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
    else:
        fused_kernel()  # a skip without a C compiler; a failure if one is there and the kernel does not build
    return request.param


@pytest.fixture
def test_data():
    """The folder of real datasets (``DSA_TEST_DATA``), or a skip saying how to get it."""
    import os
    from pathlib import Path

    root = os.environ.get("DSA_TEST_DATA")
    if not root or not Path(root).is_dir():
        pytest.skip(
            "needs the real datasets: set DSA_TEST_DATA to a folder holding their raw files (FB15k-237/, WN18RR/, Cora/, ...)"
        )
    return Path(root)


def copy_dataset(test_data, name, target):
    """Copy a read-only dataset folder where PyG may write its processed files."""
    import shutil

    shutil.copytree(test_data / name, target / name)
    for path in (target / name).rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


@pytest.fixture
def server(monkeypatch):
    """A file server on 127.0.0.1 that dataset downloads reach through $DSA_DOWNLOAD_MIRROR."""
    from dsa_train.data.downloads import MIRROR_ENV

    from .helpers import FileServer

    s = FileServer()
    monkeypatch.setenv(MIRROR_ENV, s.base)
    yield s
    s.close()
