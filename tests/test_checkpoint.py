"""Checkpoints are complete or absent; damaged ones are found out and passed over."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from dsa_train.errors import StateError
from dsa_train.runs.checkpoint_store import CheckpointStore


@pytest.fixture
def parts():
    model = torch.nn.Embedding(50, 4, sparse=True)
    return model, torch.optim.SparseAdam(model.parameters())


def save(path, step, parts, keep=5):
    return CheckpointStore(path).save(step, *parts, {"step": step}, keep=keep)


def test_keep_newest_and_ignore_scratch(tmp_path, parts):
    for step in (1, 2, 3):
        save(tmp_path, step, parts, keep=2)
    assert [p.name for p in CheckpointStore(tmp_path).complete()] == ["0000000002", "0000000003"]
    (tmp_path / ".partial-0000000009").mkdir()  # a save killed half-way
    (tmp_path / ".deleting-0000000001").mkdir()  # a prune killed half-way
    (tmp_path / "0000000008").mkdir()  # renamed but without trainer state: not complete
    assert CheckpointStore(tmp_path).find()[0].name == "0000000003"
    save(tmp_path, 4, parts, keep=2)
    assert not (tmp_path / ".partial-0000000009").exists() and not (tmp_path / ".deleting-0000000001").exists()
    path, state, warnings = CheckpointStore(tmp_path).find(4)
    assert state["step"] == 4 and warnings == [] and set(state["files"]) == {"model.pt", "optimizer.pt"}


def flip_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = [
    ("bit flip", lambda c: flip_bit(c / "model.pt"), "model.pt does not match its digest"),
    ("truncated", lambda c: os.truncate(c / "optimizer.pt", 10), "optimizer.pt does not match its digest"),
    ("file lost", lambda c: (c / "model.pt").unlink(), "lacks model.pt"),
    ("torn trainer state", lambda c: (c / "trainer.json").write_text('{"format": "dsa-tr'), "is unreadable"),
]


@pytest.mark.parametrize("damage,expected", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, parts, damage, expected):
    save(tmp_path, 1, parts)
    newest = save(tmp_path, 2, parts)
    damage(newest)
    path, state, warnings = CheckpointStore(tmp_path).find()
    assert path.name == "0000000001" and state["step"] == 1
    assert len(warnings) == 1 and expected in warnings[0] and str(newest) in warnings[0]
    with pytest.raises(StateError, match=expected):  # asked for by step: no silent substitute
        CheckpointStore(tmp_path).find(2)


def test_errors_name_what_is_wrong(tmp_path, parts):
    with pytest.raises(StateError, match="holds no complete checkpoint"):
        CheckpointStore(tmp_path).find()
    path = save(tmp_path, 7, parts, keep=1)
    with pytest.raises(StateError, match=r"no checkpoint of step 3.*"):
        CheckpointStore(tmp_path).find(3)
    state = json.loads((path / "trainer.json").read_text())
    (path / "trainer.json").write_text(json.dumps({**state, "version": 99}))
    with pytest.raises(StateError, match="version 99"):
        CheckpointStore.read_state(path)
    with pytest.raises(StateError, match="every checkpoint .* is damaged"):
        CheckpointStore(tmp_path).find()


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, parts, monkeypatch):
    first = save(tmp_path, 1, parts)
    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(StateError, match="the disk is full: checkpoint of step 2") as err:
        save(tmp_path, 2, parts)
    assert "previous checkpoints are intact" in err.value.hint
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial folder left
    monkeypatch.setattr(torch, "save", real_save)
    assert CheckpointStore(tmp_path).find()[0] == first
    assert save(tmp_path, 2, parts).name == "0000000002"  # space freed: saving works again
