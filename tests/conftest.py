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
