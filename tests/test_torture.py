"""Kill -9 at a step, a checkpoint and an evaluation, resume each time: the run ends as if
never interrupted (the small version of scripts/torture_kill.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from torture_kill import torture  # noqa: E402


@pytest.mark.slow
def test_three_kills_then_resume_equals_an_uninterrupted_run(tmp_path):
    lines = []
    result = torture(3, tmp_path, seed=1, log=lines.append)
    assert result.pop("kills") == {"step": 1, "checkpoint": 1, "evaluation": 1}, lines
    assert result == {"same final step": True, "weights equal": True, "moments equal": True, "history equal": True}


@pytest.mark.slow
def test_kills_across_delta_checkpoints_and_compactions_then_resume_equals_an_uninterrupted_run(tmp_path):
    """The entity table on disk, checkpointed every 3 steps: checkpoints are deltas of the
    changed rows and chains are compacted; a kill lands in each of a step, a checkpoint, a
    compaction and an evaluation."""
    lines = []
    result = torture(4, tmp_path, seed=1, log=lines.append, storage="disk")
    assert result.pop("kills") == {"step": 1, "checkpoint": 1, "compaction": 1, "evaluation": 1}, lines
    assert all(result.values()), (result, lines)
    victim = sorted((tmp_path / "victim" / "checkpoints").iterdir())
    assert any((c / "tables" / "entities.table.delta").exists() for c in victim)  # deltas were really written
