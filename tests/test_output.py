"""Where the library's output goes: its messages through :mod:`logging` (shown by the CLI as
`note` showed them, and by nobody else unless asked), its progress to the reporter that
:mod:`dsa_train.progress` holds. References: the texts `dsa-train` printed before either
existed, and a recording reporter."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from dsa_train import progress
from dsa_train.cli._output import NotesHandler
from dsa_train.cli.app import app
from dsa_train.data import load_knowledge_graph
from dsa_train.recipe import DatasetConfig, parse_recipe

TINY = """\
name: tiny
dataset:
  kind: synthetic
  synthetic: {entities: 300, relations: 6, triples: 4000, valid: 100, test: 100, clusters: 10, seed: 1}
model: {kind: transe, dim: 16}
train: {epochs: 2, batch_size: 512, negatives: 16, device: cpu}
eval: {final_splits: [test]}
"""


def write_kg(folder):
    folder.mkdir()
    (folder / "train.txt").write_text("a\tr\tb\nb\tr\tc\nc\tr\ta\n")
    (folder / "valid.txt").write_text("a\tr\tc\n")
    (folder / "test.txt").write_text("b\tr\ta\n")
    return folder


def changed_sources(folder) -> None:
    """Append a triple: the next load imports the folder again, and says so."""
    with open(folder / "train.txt", "a") as f:
        f.write("a\tr\td\n")


def train(path, overrides=()):
    """A tiny run, from the library (no CLI): its summary."""
    from dsa_train.train.loop import Training
    from dsa_train.runs.run_folder import RunFolder

    recipe = parse_recipe(TINY, source="test", overrides=list(overrides))
    folder = RunFolder.create(recipe, path)
    training = Training(recipe, folder)
    try:
        training.setup(resume=False)
        return training.train()
    finally:
        training.close()
        folder.release()


def test_a_library_call_speaks_to_the_logging_handler_a_user_attaches(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dsa_train")
    folder = write_kg(tmp_path / "kg")
    first = load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))
    assert not caplog.records  # a first import has nothing to say
    changed_sources(folder)
    load_knowledge_graph(DatasetConfig(kind="tsv", path=str(folder)))
    [record] = caplog.records
    assert record.name == "dsa_train.data.store" and record.levelno == logging.INFO
    assert record.getMessage() == f"the sources of '{first.dataset.folder}' changed: importing 'kg' again"
    caplog.clear()
    train(tmp_path / "run")
    said = [r.getMessage() for r in caplog.records if r.name == "dsa_train.train.loop"]
    assert said[0].startswith("synthetic-300: 300 entities") and said[-1].startswith(
        "checkpoints: "
    )  # what the loop's setup says


def test_without_logging_configured_the_library_prints_nothing(tmp_path):
    folder = write_kg(tmp_path / "kg")
    script = textwrap.dedent(f"""
        import logging
        from dsa_train.data import load_knowledge_graph
        from dsa_train.recipe import DatasetConfig, parse_recipe, with_data_root
        load_knowledge_graph(DatasetConfig(kind="tsv", path={str(folder)!r}))
        with open({str(folder / "train.txt")!r}, "a") as f:
            f.write("a\\tr\\td\\n")
        kg = load_knowledge_graph(DatasetConfig(kind="tsv", path={str(folder)!r}))
        assert kg.dataset.fresh  # imported again: logged, at INFO
        run = parse_recipe("name: r\\ndataset: {{kind: tsv, path: kg, root: /elsewhere}}\\nmodel: {{kind: transe}}\\n", source="r")
        with_data_root(run, stored=True)  # $DSA_DATA_ROOT wins over the run's root: logged, a WARNING
        logging.basicConfig(format="configured: %(message)s")  # the application configures logging: shown from here
        with_data_root(run, stored=True)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (
        done.stderr.startswith("configured: data root: $DSA_DATA_ROOT")
        and done.stderr.count("data root") == 1
        and not done.stdout
    )


def test_the_command_line_prints_the_messages_on_stderr_as_note_did(tmp_path, notes):
    folder = write_kg(tmp_path / "kg")
    assert CliRunner().invoke(app, ["import", str(folder), "--json"]).exit_code == 0
    changed_sources(folder)
    imported = CliRunner().invoke(app, ["import", str(folder), "--json"])
    assert imported.exit_code == 0, imported.output
    where = json.loads(imported.stdout)["folder"]
    # what `dsa-train import` printed before logging existed, word for word (rich may wrap it)
    assert imported.stderr.split() == f"the sources of '{where}' changed: importing 'kg' again".split()

    recipe, out = tmp_path / "tiny.yaml", tmp_path / "run"
    recipe.write_text(TINY)
    notes.clear()
    result = CliRunner().invoke(app, ["run", str(recipe), "-o", str(out)], terminal_width=300)
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    # as printed before: the run folder (now the lifecycle's note), then the loop's notes, one plain line each
    assert lines[0] == f"run folder: {out}"
    assert lines[1].startswith("synthetic-300: 300 entities, 6 relations, ") and lines[1].endswith(
        " train / valid / test triples"
    )
    assert lines[2].startswith("checkpoints: deltas of changed rows")
    assert lines[0:3] == notes and not any(line.startswith(("INFO", "WARNING", "dsa_train")) for line in lines)
    assert lines[3].startswith("epoch 1: loss ") and lines[-1].startswith("test: MRR ")  # the progress lines, as before
    library = logging.getLogger("dsa_train")  # the command's handler is gone, the logger as it was
    assert (
        not any(isinstance(h, NotesHandler) for h in library.handlers)
        and library.propagate
        and library.level == logging.INFO
    )
    assert isinstance(progress.current(), progress.SilentReporter)


class Recording(progress.SilentReporter):
    def __init__(self, fail_at_step: int | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail_at_step = fail_at_step

    def epoch_start(self, epoch, epochs, steps, done):
        self.calls.append(("epoch_start", epoch, epochs, steps, done))

    def step_done(self, steps, loss, rate, unit):
        self.calls.append(("step_done", unit))
        if sum(c[0] == "step_done" for c in self.calls) == self.fail_at_step:
            raise RuntimeError("the reporter failed")

    def eval_done(self, split, summary):
        self.calls.append(("eval_done", split))


def test_progress_goes_to_the_installed_reporter_and_nowhere_without_one(tmp_path):
    default = progress.current()
    assert isinstance(default, progress.SilentReporter)  # nothing installed: heard, not shown
    train(tmp_path / "quiet")  # runs with the silent default
    recording = Recording()
    with progress.reporting(recording):
        assert progress.current() is recording
        summary = train(tmp_path / "heard")
    assert progress.current() is default  # removed afterwards
    steps = summary["step"] // 2  # 2 epochs
    assert [c for c in recording.calls if c[0] == "epoch_start"] == [
        ("epoch_start", 1, 2, steps, 0),
        ("epoch_start", 2, 2, steps, 0),
    ]
    assert recording.calls.count(("step_done", "triples")) == summary["step"]
    assert recording.calls[-1] == ("eval_done", "test")

    failing = Recording(fail_at_step=3)
    with pytest.raises(RuntimeError, match="the reporter failed"), progress.reporting(failing):
        train(tmp_path / "failed")
    assert progress.current() is default  # removed after an error too
    assert failing.calls.count(("step_done", "triples")) == 3
