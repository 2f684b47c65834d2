"""Ctrl-C during `dsa-train run`: the step under way ends, a checkpoint of it is written, the
CLI says how to continue and exits 130; `--resume` then finishes the run. A second Ctrl-C
stops at once. The reference: the checkpoint on disk and the resumed run's step count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RECIPE = """
name: slow
dataset:
  kind: synthetic
  synthetic: {entities: 3000, relations: 6, triples: 30000, valid: 50, test: 50, seed: 2}
model: {kind: transe, dim: 32}
train: {epochs: 3, batch_size: 64, negatives: 64, log_every: 1, device: cpu}
eval: {final_splits: []}
"""


def _train_records(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return metrics.read_text().count('"kind": "train"') if metrics.exists() else 0


def _start(recipe: Path, run: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dsa_train", "run", str(recipe), "-o", str(run), *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_steps(process: subprocess.Popen, run: Path, steps: int) -> None:
    deadline = time.monotonic() + 120
    while _train_records(run) < steps:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_resume_finishes(tmp_path):
    recipe, run = tmp_path / "slow.yaml", tmp_path / "run"
    recipe.write_text(RECIPE)
    process = _start(recipe, run)
    _wait_for_steps(process, run, 5)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    line = next(line for line in stderr.splitlines() if line.startswith("Interrupted at step"))
    step = int(line.split("step ")[1].split(",")[0].replace(",", ""))
    assert "checkpoint written" in line and f"--resume -o {run}" in line and "Traceback" not in stderr
    assert (run / "checkpoints" / f"{step:010d}" / "trainer.json").is_file()
    resumed = _start(recipe, run, "--resume")
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr
    records = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["epochs"] == 3 and summary["step"] > step
    # every step logged once, in order: the log was cut back to the checkpoint and continued
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, summary["step"] + 1))


def test_the_first_ctrl_c_asks_to_stop_and_the_second_stops_at_once():

    from dsa_train.train.callbacks import CheckpointOnInterrupt
    from dsa_train.train.loop import Training

    training = Training.__new__(Training)  # only what the handler touches
    training.world = None
    before = signal.getsignal(signal.SIGINT)
    with CheckpointOnInterrupt().running(training):
        signal.raise_signal(signal.SIGINT)
        assert training.interrupted  # noted: the loop checkpoints after this step
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back
