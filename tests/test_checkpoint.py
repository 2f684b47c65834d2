"""Checkpoints are complete or absent; the newest complete one wins."""

from __future__ import annotations

import json

import pytest
import torch

from dsa_train.errors import StateError
from dsa_train.train.checkpoint import checkpoint_at, complete_checkpoints, read_trainer_state, save_checkpoint


@pytest.fixture
def parts():
    model = torch.nn.Embedding(5, 2, sparse=True)
    return model, torch.optim.SparseAdam(model.parameters())


def test_keep_newest_and_ignore_partial(tmp_path, parts):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, *parts, {"step": step}, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["0000000002", "0000000003"]
    (tmp_path / ".partial-0000000009").mkdir()  # a save killed half-way
    (tmp_path / "0000000008").mkdir()  # renamed but without trainer state: not complete
    assert checkpoint_at(tmp_path, None).name == "0000000003"
    save_checkpoint(tmp_path, 4, *parts, {"step": 4}, keep=2)
    assert not (tmp_path / ".partial-0000000009").exists()
    assert read_trainer_state(checkpoint_at(tmp_path, 4))["step"] == 4


def test_errors_name_what_is_wrong(tmp_path, parts):
    with pytest.raises(StateError, match="holds no complete checkpoint"):
        checkpoint_at(tmp_path, None)
    path = save_checkpoint(tmp_path, 7, *parts, {"step": 7}, keep=1)
    with pytest.raises(StateError, match=r"no checkpoint of step 3"):
        checkpoint_at(tmp_path, 3)
    state = json.loads((path / "trainer.json").read_text())
    (path / "trainer.json").write_text(json.dumps({**state, "version": 99}))
    with pytest.raises(StateError, match="version 99"):
        read_trainer_state(path)
    (path / "trainer.json").write_text("{torn")
    with pytest.raises(StateError, match="unreadable"):
        read_trainer_state(path)
