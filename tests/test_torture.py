"""Kill -9 at a step, a checkpoint and an evaluation, resume each time: the run ends as if
never interrupted (the small version of scripts/torture_kill.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from torture_kill import torture  # noqa: E402


def test_three_kills_then_resume_equals_an_uninterrupted_run(tmp_path):
    lines = []
    result = torture(3, tmp_path, seed=1, log=lines.append)
    assert result.pop("kills") == {"step": 1, "checkpoint": 1, "evaluation": 1}, lines
    assert result == {"same final step": True, "weights equal": True, "moments equal": True, "history equal": True}
