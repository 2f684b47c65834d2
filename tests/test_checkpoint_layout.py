"""The checkpoint layout's one rule of which checkpoints stay, against a hand-made folder."""

from __future__ import annotations

import json

from dsa_train.train.checkpoint_layout import CHECKPOINT_FORMAT, TRAINER, complete_checkpoints, retained, step_name


def _checkpoint(folder, step: int, needs: list[str]) -> None:
    path = folder / step_name(step)
    path.mkdir(parents=True)
    (path / TRAINER).write_text(json.dumps({"format": CHECKPOINT_FORMAT, "needs": needs}))


def test_the_newest_stay_with_the_checkpoints_their_deltas_need(tmp_path):
    _checkpoint(tmp_path, 10, [])
    _checkpoint(tmp_path, 20, [])
    _checkpoint(tmp_path, 30, [step_name(10)])  # deltas on step 10's files
    _checkpoint(tmp_path, 40, [step_name(10), step_name(30)])
    (tmp_path / ".partial-0000000050").mkdir()  # never complete
    complete = complete_checkpoints(tmp_path)
    assert [p.name for p in complete] == [step_name(s) for s in (10, 20, 30, 40)]
    kept = retained(complete, 1)
    assert sorted(p.name for p in kept) == [step_name(10), step_name(30), step_name(40)]  # 20 goes
    assert kept[tmp_path / step_name(40)] == "one of the newest 1 checkpoints"
    assert "checkpoint 0000000040 is made of its deltas" in kept[tmp_path / step_name(10)]
    held = retained(complete, 0, held={tmp_path / step_name(20): "its optimizer state is open"})
    assert held == {tmp_path / step_name(20): "its optimizer state is open"}  # keeps nothing else: 20 needs none
    assert retained(complete, 0) == {}
