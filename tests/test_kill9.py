"""A real ``kill -9`` in the default suite (the slow torture tests kill more): a small run in a
child process is killed by SIGKILL at a step boundary; its ``--resume``, another child, is
killed inside a checkpoint (its model and optimizer files written, its trainer.json not yet);
a last ``--resume`` then ends with the metrics history (timing fields aside), the final
checkpoint's tensors, its table and its row files of an uninterrupted run, bit for bit."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from dsa_train.runs.checkpoint_store import CheckpointStore

from .helpers import assert_same_tensors, fill, small_tmpfs
from .test_checkpoint_deltas import cli, final_versions, history

RECIPE = """\
name: killed
description: a small run with its table on disk, checkpointed every 3 steps
dataset:
  kind: synthetic
  synthetic: {entities: 1000, relations: 8, triples: 2000, valid: 50, test: 50, clusters: 8, seed: 5}
model: {kind: distmult, dim: 16, init_std: 0.05, dropout: 0.1, embedding_storage: disk}
train: {epochs: 1, max_steps: 8, batch_size: 64, negatives: 16, log_every: 1, checkpoint_every: 3, keep_checkpoints: 5}
optimizer: {kind: dsa, lr: 0.01}
eval: {final_splits: [test], entity_chunk: 1000}
"""

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from dsa_train.runs import checkpoint_rows
    from dsa_train.train import loop

    where, at = {where!r}, {at}
    if where == "step":  # as step `at` is about to start: the step before it complete, no checkpoint since 3
        real_step = loop.Training.step

        def step(self, picked):
            if self.step_count == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_step(self, picked)

        loop.Training.step = step
    else:  # inside checkpoint `at`: its model and optimizer files written, trainer.json not yet
        real_snapshot = checkpoint_rows.snapshot_optimizer

        def snapshot_optimizer(optimizer, partial, *args):
            real_snapshot(optimizer, partial, *args)
            if partial.name.endswith("%010d" % at):
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint_rows.snapshot_optimizer = snapshot_optimizer
    from dsa_train.cli.app import main
    sys.argv = ["dsa-train", "run", {recipe!r}, "--output", {out!r}, *{more!r}]
    main()
    """
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    (root / "killed.yaml").write_text(RECIPE)
    done = cli("run", root / "killed.yaml", "--output", root / "whole")
    assert done.exit_code == 0, done.stderr
    return root / "killed.yaml", root / "whole"


def final_model(run) -> dict:
    final = CheckpointStore(run / "checkpoints").complete()[-1]
    return torch.load(final / "model.pt", weights_only=True)


def killed(victim, recipe, where: str, at: int, *more: str) -> str:
    """Run ``dsa-train run`` in a child process that SIGKILLs itself ``where`` (``step``,
    ``checkpoint``) ``at``; its stderr."""
    script = CHILD.format(where=where, at=at, recipe=str(recipe), out=str(victim), more=list(more))
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    return child.stderr


def complete(victim) -> list[str]:
    return [c.name for c in CheckpointStore(victim / "checkpoints").complete()]


def test_kill_9_at_a_step_and_inside_a_checkpoint_then_resume_ends_as_the_uninterrupted_run(uninterrupted, tmp_path):
    recipe, whole = uninterrupted
    victim = tmp_path / "victim"
    killed(victim, recipe, "step", 5)
    assert complete(victim) == ["0000000003"]  # killed after checkpoint 3, before step 5 and checkpoint 6
    second = killed(victim, recipe, "checkpoint", 6, "--resume")
    assert "resuming from" in second and "step 3" in second, second[-2000:]
    partial = victim / "checkpoints" / ".partial-0000000006"
    assert (partial / "model.pt").exists() and not (partial / "trainer.json").exists()  # the kill was inside it
    assert complete(victim) == ["0000000003"]
    resumed = cli("run", recipe, "--output", victim, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and "step 3" in resumed.stderr, resumed.stderr
    assert history(victim) == history(whole) and len(history(whole)) >= 8
    assert_same_tensors(final_model(victim), final_model(whole), "the final checkpoint's model.pt")
    ours, theirs = final_versions(victim), final_versions(whole)
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)


def test_a_full_disk_inside_a_checkpoint_then_resume_ends_as_the_uninterrupted_run(
    uninterrupted, tmp_path, monkeypatch
):
    """A real full file system (a small tmpfs filled up as checkpoint 6 starts) under the run
    folder, its DiskSparseAdam state and its disk table: the checkpoint fails with a StateError
    naming the step, leaves no partial folder and checkpoint 3 intact; once space is freed
    ``--resume`` ends as the uninterrupted run."""
    from dsa_train.runs import checkpoint_rows

    recipe, whole = uninterrupted
    real = checkpoint_rows.write_checkpoint

    def on_a_full_disk(partial, *args):
        if partial.name.endswith("0000000006"):
            fill(disk, leave=16 << 10)  # room for model.pt, not for the rows' deltas
        return real(partial, *args)

    with small_tmpfs(tmp_path / "disk", "16m") as disk:
        victim = disk / "victim"
        monkeypatch.setattr(checkpoint_rows, "write_checkpoint", on_a_full_disk)
        failed = cli("run", recipe, "--output", victim)
        assert failed.exit_code == 1, failed.stderr
        assert "the disk is full" in failed.stderr and "checkpoint of step 6" in failed.stderr, failed.stderr
        assert complete(victim) == ["0000000003"]
        assert not list((victim / "checkpoints").glob(".partial-*"))
        monkeypatch.setattr(checkpoint_rows, "write_checkpoint", real)
        (disk / "filler").unlink()  # space freed
        resumed = cli("run", recipe, "--output", victim, "--resume")
        assert resumed.exit_code == 0, resumed.stderr
        assert "resuming from" in resumed.stderr and "step 3" in resumed.stderr, resumed.stderr
        assert history(victim) == history(whole)
        assert_same_tensors(final_model(victim), final_model(whole), "the final checkpoint's model.pt")
        ours, theirs = final_versions(victim), final_versions(whole)
        assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)
