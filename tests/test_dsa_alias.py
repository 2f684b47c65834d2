"""``from dsa import DiskSparseAdam``, as the seed writes it: the same objects as dsa_train's."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import dsa_train


def test_every_public_name_is_dsa_trains_own_object():
    import dsa

    assert dsa.__all__ == dsa_train.__all__
    for name in dsa.__all__:
        assert getattr(dsa, name) is getattr(dsa_train, name), name
    with pytest.raises(AttributeError, match="module 'dsa' has no attribute 'SparseAdam'.*DiskSparseAdam"):
        dsa.SparseAdam  # noqa: B018


def test_the_seeds_example_runs_unchanged_and_steps_as_sparse_adam(tmp_path):
    """In a fresh interpreter, the seed's import and a few steps, against torch.optim.SparseAdam."""
    program = f"""
import torch
from dsa import DiskSparseAdam

torch.manual_seed(0)
ours = torch.nn.Embedding(100, 8, sparse=True)
theirs = torch.nn.Embedding(100, 8, sparse=True)
theirs.load_state_dict(ours.state_dict())
opt = DiskSparseAdam(ours.parameters(), lr=0.01, state_dir={str(tmp_path / "state")!r})
reference = torch.optim.SparseAdam(theirs.parameters(), lr=0.01)
for step in range(5):
    ids = torch.randint(0, 100, (32,))
    for model, optimizer in ((ours, opt), (theirs, reference)):
        optimizer.zero_grad()
        model(ids).pow(2).sum().backward()
        optimizer.step()
assert torch.equal(ours.weight, theirs.weight)
opt.close()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_dsa_trains_light_import_stays_light():
    """Importing the alias imports no torch (dsa_train's names load on first use)."""
    program = "import sys, dsa; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert torch  # (this test module's own import of torch does not reach the child)
