"""dsa-train runs on Linux only: elsewhere it stops at start with an error saying so.

The reference is what the user sees: the CLI's error line and exit code, and the optimizer
refusing to open (never an AttributeError from a missing os function later)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dsa_train import DiskSparseAdam
from dsa_train.errors import DsaError


def test_the_cli_stops_at_start_on_another_system():
    code = "import sys; sys.platform = 'darwin'; sys.argv = ['dsa-train', 'recipes']; from dsa_train.cli.app import main; main()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith("Error: dsa-train runs on Linux only") and "this is darwin" in result.stderr
    assert "Hint: run it on Linux" in result.stderr and "Traceback" not in result.stderr


def test_the_optimizer_refuses_another_system(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(DsaError, match="DiskSparseAdam runs on Linux only"):
        DiskSparseAdam([torch.nn.Parameter(torch.zeros(3, 2))], state_dir=tmp_path / "s")
    assert not (tmp_path / "s").exists()  # refused before anything was written


def test_the_cli_prints_no_known_third_party_warning(tmp_path):
    """PyG's torch.jit.script deprecation and torch's sparse-invariant note are not printed."""
    code = (
        "import sys, warnings; sys.argv = ['dsa-train', 'validate', 'quickstart'];"
        "from dsa_train.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import torch_geometric  # noqa: F401  (what a training command imports, after main() started)\n"
        "warnings.warn('`torch.jit.script` is deprecated. Please switch to torch.compile', FutureWarning)"
    )
    result = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert "valid" in result.stdout
    assert "jit.script" not in result.stderr, result.stderr
