"""The checkpoint store's one rule of which checkpoints stay, against a hand-made folder."""

from __future__ import annotations

import json

from dsa_train.runs.checkpoint_layout import CHECKPOINT_FORMAT, TRAINER, step_name
from dsa_train.runs.checkpoint_store import CheckpointStore


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
    store = CheckpointStore(tmp_path)
    complete = store.complete()
    assert [p.name for p in complete] == [step_name(s) for s in (10, 20, 30, 40)]
    kept = store.retained(1)
    assert sorted(p.name for p in kept) == [step_name(10), step_name(30), step_name(40)]  # 20 goes
    assert kept[tmp_path / step_name(40)] == "one of the newest 1 checkpoints"
    assert "checkpoint 0000000040 is made of its deltas" in kept[tmp_path / step_name(10)]
    held = store.retained(0, held={tmp_path / step_name(20): "its optimizer state is open"})
    assert held == {tmp_path / step_name(20): "its optimizer state is open"}  # keeps nothing else: 20 needs none
    assert store.retained(0) == {}


def test_the_store_names_every_part_of_the_layout_as_its_docstring_draws_it(tmp_path):
    """The names written to disk (docs/checkpoints.md): a format change shows up here."""
    store = CheckpointStore.of_run(tmp_path)
    assert store.folder == tmp_path / "checkpoints"
    step = store.get_checkpoint_dir(200)
    assert step == tmp_path / "checkpoints" / "0000000200"
    assert store.get_partial_dir(400) == tmp_path / "checkpoints" / ".partial-0000000400"
    assert store.get_doomed_dir(step) == tmp_path / "checkpoints" / ".deleting-0000000200"
    assert (store.get_trainer_file(step), store.get_model_file(step), store.get_tables_dir(step)) == (
        step / "trainer.json",
        step / "model.pt",
        step / "tables",
    )
    assert store.is_scratch_name(".partial-0000000400") and store.is_scratch_name(".deleting-0000000200")
    assert not store.is_scratch_name("0000000200")
