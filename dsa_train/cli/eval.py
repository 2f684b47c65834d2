"""``dsa-train eval``: rank a split with a run's checkpoint."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import typer

from ..train.run_folder import RunFolder
from ._errors import handle_errors
from ._output import ProgressReporter, metrics_table, stderr, stdout
from .run import Device


class Split(str, Enum):
    valid = "valid"
    test = "test"


@handle_errors
def eval_(
    run_dir: Path = typer.Argument(..., help="A run folder that `dsa-train run` made.", show_default=False),
    split: Split = typer.Option(Split.test, "--split", help="The split to rank."),
    checkpoint: int | None = typer.Option(None, "--checkpoint", help="The step of the checkpoint. Default: the newest.", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout instead of a table."),
    device: Device | None = typer.Option(None, "--device", help="Where to score. Default: the run's train.device."),
) -> None:
    """Score a run's checkpoint: filtered ranking for knowledge graphs, probe or link metrics for graphs.

    Examples:

      dsa-train eval runs/quickstart-20261202-141500

      dsa-train eval runs/quickstart-20261202-141500 --split valid --checkpoint 400 --json
    """
    from ..train.loop import SilentReporter, evaluate_run  # torch and PyG: imported only when evaluating

    class NotesOnly(SilentReporter):
        """--json: no progress, but every warning on stderr and in the document."""

        def __init__(self) -> None:
            self.notes: list[str] = []

        def note(self, text: str) -> None:
            self.notes.append(text)
            stderr.print(text, highlight=False)

    run = RunFolder.find(run_dir)
    reporter = ProgressReporter() if not as_json else NotesOnly()
    path, metrics, _ = evaluate_run(run, split.value, checkpoint=checkpoint, device=device.value if device else None, reporter=reporter)
    if as_json:
        document = {
            "run": str(run.path),
            "checkpoint": int(path.name),
            "split": split.value,
            "metrics": metrics,
            "warnings": reporter.notes,
        }
        typer.echo(json.dumps(document, indent=2))
    else:
        stdout.print(metrics_table(f"{run.path.name}, checkpoint {int(path.name)}: {split.value}", metrics))
