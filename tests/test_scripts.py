"""The shell scripts for Colab and GPU boxes: help, refusals, and a check on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def bash(*args, **env):
    environment = {**os.environ, "PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env}
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, env=environment, timeout=300)


@pytest.mark.parametrize("script", ["setup_box.sh", "run_benchmarks.sh"])
def test_help_and_unknown_options(script):
    text = (SCRIPTS / script).read_text()
    assert "set -euo pipefail" in text
    shown = bash(SCRIPTS / script, "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("Usage: scripts/")
    wrong = bash(SCRIPTS / script, "--bogus")
    assert wrong.returncode == 2 and "unknown option --bogus" in wrong.stderr


def test_setup_box_checks_this_machine(tmp_path):
    result = bash(SCRIPTS / "setup_box.sh", "--no-install", "--check-only", "--state-dir", tmp_path / "state")
    assert result.returncode == 0, result.stderr
    for line in ("python ", "torch ", "cuda ", "fast path ", f"state disk  {tmp_path / 'state'}"):
        assert line in result.stdout


def test_out_of_core_benchmark_runs_quick(tmp_path):
    """The scale benchmark's small version runs end to end and prints every figure."""
    script = SCRIPTS / "bench_out_of_core.py"
    result = subprocess.run(
        [sys.executable, script, "--dir", tmp_path, "--quick"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    for line in ("disk random 4 KiB reads", "cold rows paged in", "with prefetch / without", "peak resident anonymous memory"):
        assert line in result.stdout
    assert not list(tmp_path.iterdir()), "the benchmark left its table behind"


def test_import_benchmark_runs_quick(tmp_path):
    """The import benchmark's small version runs both parsers and checks they agree on the counts."""
    result = subprocess.run(
        [sys.executable, SCRIPTS / "bench_import.py", "--triples", "20000", "--entities", "3000", "--held-out", "100",
         "--folder", tmp_path, "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    report = json.loads(result.stdout)
    assert report["counts (entities relations train valid test)"].split()[2:] == ["20000", "100", "100"]
    assert report["import"]["peak_rss"] > 0 and report["speedup (old / import)"] > 0
