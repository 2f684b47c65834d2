"""``dsa-train eval``: rank a split with a run's checkpoint."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import typer

from ..runs.run_folder import RunFolder, is_job, job_checkpoints
from ..errors import DsaError
from ._errors import handle_errors
from ._output import ProgressReporter, command_output, metrics_table, stdout
from ._launch import Device, launch_local


class Split(str, Enum):
    valid = "valid"
    test = "test"


@handle_errors
def eval_(
    run_dir: Path = typer.Argument(..., help="A run folder that `dsa-train run` made.", show_default=False),
    split: Split = typer.Option(Split.test, "--split", help="The split to rank."),
    checkpoint: int | None = typer.Option(
        None, "--checkpoint", help="The step of the checkpoint. Default: the newest.", show_default=False
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout instead of a table."),
    device: Device | None = typer.Option(None, "--device", help="Where to score. Default: the run's train.device."),
    save_ranks: Path | None = typer.Option(
        None,
        "--save-ranks",
        metavar="FILE",
        help="Also write each query's filtered rank to FILE (TSV: side, head, relation, tail, rank). The ids are the dataset's rows, "
        "numbered in fingerprint order, not file order: map them to names with `dsa-train export` (its names file) or open_run(RUN).names(...).",
        show_default=False,
    ),
) -> None:
    """Score a run's checkpoint: filtered ranking for knowledge graphs, probe or link metrics for graphs.

    Examples:

      dsa-train eval runs/quickstart-20261202-141500

      dsa-train eval runs/quickstart-20261202-141500 --split valid --checkpoint 400 --json

      dsa-train eval runs/quickstart-20261202-141500 --save-ranks ranks.tsv
    """
    from ..train.loop import evaluate_run  # torch and PyG: imported only when evaluating

    run = RunFolder.find(run_dir)
    if save_ranks is not None and (save_ranks.is_dir() or not save_ranks.parent.is_dir()):
        raise DsaError(
            f"--save-ranks: '{save_ranks}' is a folder"
            if save_ranks.is_dir()
            else f"--save-ranks: the folder of '{save_ranks}' does not exist",
            hint="give the path of a file in an existing folder, e.g. --save-ranks ranks.tsv",
        )
    world = None
    if is_job(run.path):  # trained over several processes: each scores the rows it holds
        from ..distributed.group import from_environment
        from ..train.sharded_run import evaluate_rank

        world = from_environment()
        if world is None:  # the job's folders are here: start its processes on this machine
            raise typer.Exit(launch_local(_job_world_size(run.path)))
    leader = world is None or world.is_leader
    notes: list[str] = []  # --json: every note on stderr and in the document too, no progress
    where = device.value if device else None
    with command_output(
        ProgressReporter() if leader and not as_json else None, shown=leader, kept=notes if as_json else None
    ):
        if world is None:
            path, metrics, _ = evaluate_run(
                run, split.value, checkpoint=checkpoint, device=where, save_ranks=save_ranks
            )
        elif save_ranks is not None:
            raise DsaError(
                "--save-ranks is not supported for a run over several processes yet", hint="leave out --save-ranks"
            )
        else:
            path, metrics, _ = evaluate_rank(run.path, world, split.value, checkpoint=checkpoint, device=where)
    if not leader:
        return
    if as_json:
        document = {
            "run": str(run.path),
            "checkpoint": int(path.name),
            "split": split.value,
            "metrics": metrics,
            "warnings": notes,
        }
        typer.echo(json.dumps(document, indent=2))
    else:
        stdout.print(metrics_table(f"{run.path.name}, checkpoint {int(path.name)}: {split.value}", metrics))


def _job_world_size(folder: Path) -> int:
    """How many ranks wrote the job's complete checkpoints."""
    listed = job_checkpoints(folder)
    if listed is None or not listed[1]:
        raise DsaError(
            f"'{folder}' is a run over several processes without a complete checkpoint (its checkpoints.json lists none)",
            hint="train it to its first checkpoint (train.checkpoint_every) or to its end",
        )
    return listed[0]
