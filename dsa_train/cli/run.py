"""``dsa-train run``: train a model from a recipe."""

from __future__ import annotations

from pathlib import Path

import typer

from ..recipe import Recipe, load_recipe, with_data_root
from ..recipe.find import find_recipe
from ._errors import handle_errors
from ._launch import Device, launch_local
from ._output import ProgressReporter, command_output, print_final_metrics, stderr, stdout


@handle_errors
def run(
    recipe: Path = typer.Argument(
        ...,
        help="The recipe: a YAML file, or a shipped recipe's name (dsa-train recipes lists them).",
        show_default=False,
    ),
    set_: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        help="Override a recipe key, e.g. --set train.epochs=5 (repeatable).",
        show_default=False,
    ),
    output: Path | None = typer.Option(
        None,
        "--output",
        "-o",
        help="The run folder. Default: <output.dir>/<recipe name>-<timestamp>.",
        show_default=False,
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --output (default: this recipe's newest run) from its newest checkpoint.",
    ),
    device: Device | None = typer.Option(
        None, "--device", help="Where the model computes. Default: the recipe's train.device."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the recipe and show what would run; train nothing."),
    init_from: Path | None = typer.Option(
        None,
        "--init-from",
        metavar="RUN",
        show_default=False,
        help="Start the rows from a finished run's, matched by name (model.init_from); rows it lacks start as drawn.",
    ),
    nproc: int | None = typer.Option(
        None,
        "--nproc",
        min=1,
        show_default=False,
        metavar="N",
        help="Train over this many processes on this machine, the entity table split between them "
        "(as torchrun --standalone --nproc-per-node N -m dsa_train run ... would; see docs/distributed.md).",
    ),
) -> None:
    """Train a model from a recipe; writes a run folder with metrics and checkpoints.

    Examples:

      dsa-train run quickstart

      dsa-train run recipes/quickstart.yaml

      dsa-train run recipes/fb15k237-distmult.yaml --set train.epochs=5 --device cpu

      dsa-train run recipes/fb15k237-distmult.yaml --resume

      dsa-train run recipes/grown-graph.yaml --init-from runs/fb15k237-distmult-20261202-141500

      dsa-train run recipes/fb15k237-distmult.yaml --nproc 2

      torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --rdzv-endpoint HOST:29500 -m dsa_train run recipes/x.yaml
    """
    overrides = (
        list(set_)
        + ([f"train.device={device.value}"] if device else [])
        + ([f"model.init_from={init_from.resolve()}"] if init_from else [])
    )
    config = with_data_root(load_recipe(find_recipe(recipe), overrides))  # stored resolved: eval needs no environment
    if nproc is not None and not dry_run:
        raise typer.Exit(launch_local(nproc))
    from ..distributed.group import from_environment

    world = from_environment()
    if world is not None and not dry_run:
        _run_rank(config, world, output=output, resume=resume, overrides=overrides)
        return
    if dry_run:
        where = output or (Path(config.output.dir) / f"{config.output.run_name or config.name + '-<timestamp>'}")
        stdout.print(
            f"would {'resume' if resume else 'train'} {config.model.kind} (dim {config.model.dim}) on {config.dataset.kind} "
            f"for {config.train.epochs} epochs{f' or {config.train.max_steps} steps' if config.train.max_steps else ''} "
            f"with {config.optimizer.kind} ({_rate(config.optimizer)}) on device {config.train.device}, into {where}",
            highlight=False,
        )
        from ..train.estimate import estimate

        for line in estimate(config).lines(output=Path(where).parent if output is None else Path(output).parent):
            stdout.print(line, highlight=False, soft_wrap=True)
        return
    with command_output(ProgressReporter()):
        _train(config, recipe, output=output, resume=resume, overrides=overrides)


def _train(config: Recipe, recipe: Path, *, output: Path | None, resume: bool, overrides: list[str]) -> None:
    """Train (or resume) the run in this process, then print its final metrics and summary."""
    from ..results.warm_start import carry_over
    from ..train.lifecycle import RunInterrupted, train_run

    try:
        result = train_run(config, output=output, resume=resume, overrides=overrides, warm_start=carry_over)
    except RunInterrupted as e:
        typer.echo("", err=True)
        typer.echo(
            f"Interrupted at step {e.step:,}"
            + (", checkpoint written" if e.checkpointed else "")
            + f". Continue with: dsa-train run {recipe} --resume -o {e.folder}",
            err=True,
        )
        raise typer.Exit(130) from None
    summary = result.summary
    if result.already_finished:
        stdout.print(
            f"{result.folder} is finished: {_count(summary['step'], 'step')}, {_count(summary['epochs'], 'epoch')}; nothing to resume. "
            f"Its final metrics are in metrics.jsonl (dsa-train eval {result.folder} scores it again); "
            "to train longer, resume with --set train.epochs=<more>",
            highlight=False,
            soft_wrap=True,
        )
        return
    print_final_metrics(result.recipe.name, result.final_metrics)
    stdout.print(
        f"{summary['step']:,} steps, {summary['epochs']} epochs in {summary['seconds']:,.0f} s; peak RSS "
        f"{summary['peak_rss_mib']:,.0f} MiB (anonymous {summary['peak_rss_anon_mib']:,.0f} MiB), optimizer RAM {summary['optimizer_ram_mib']:,.1f} MiB, "
        f"optimizer state on disk {summary['optimizer_state_on_disk_mib']:,.1f} MiB"
        + (
            f" (memory budget {summary['optimizer_memory_budget_mib']:,.0f} MiB)"
            if summary.get("optimizer_memory_budget_mib") is not None
            else ""
        )
        + (f", disk tables {summary['tables_on_disk_mib']:,.1f} MiB" if summary["tables_on_disk_mib"] else "")
        + _buffer_line(summary.get("buffer"))
        + _best_line(summary)
        + f"\nrun folder: {result.folder}",
        highlight=False,
        soft_wrap=True,  # one line each, never broken inside a value: a terminal wraps it, a log keeps it whole
    )


def _best_line(summary: dict) -> str:
    """eval.select_best and eval.patience: which evaluation was best, and what the figures are of."""
    best = summary.get("best")
    if not best:
        return ""
    line = f"\nbest {best['metric']} during training {best['value']:.4f} after epoch {best['epoch']} (step {best['step']:,})"
    if summary.get("stopped_early"):
        line += "; stopped early (eval.patience)"
    if summary.get("final_from_step") == best["step"] != summary["step"]:
        line += f"; the final metrics are that checkpoint's (dsa-train eval RUN --checkpoint {best['step']})"
    return line


def _buffer_line(buffer: dict | None) -> str:
    """Partition order's memory and traffic, for the summary."""
    if not buffer:
        return ""
    line = (
        f"\npartition buffer: {buffer['buffer']} of {buffer['partitions']} partitions of {buffer['partition_mib']:,.0f} MiB "
        f"in memory (+1 while the next is read)"
    )
    if "loads" in buffer:
        line += (
            f"; {buffer['loads']:,} partitions read ({buffer['read_bytes'] / 2**30:,.1f} GiB), {buffer['wait_seconds']:,.1f} s waited "
            f"for them; at most {buffer['peak_partitions']} in memory at once"
        )
    return line


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _run_rank(config: Recipe, world, *, output: Path | None, resume: bool, overrides: list[str]) -> None:
    """This process is one rank of a torchrun job: train its shard; rank 0 reports."""
    from ..train.sharded_run import train_rank

    if world.is_leader:
        stderr.print(
            f"rank 0 of {world.world_size}: {config.name}, entity table split over {world.world_size} ranks",
            highlight=False,
        )
    with command_output(ProgressReporter() if world.is_leader else None, shown=world.is_leader):
        training, top, summary = train_rank(config, world, output=output, resume=resume, overrides=overrides)
    config = training.recipe
    if not world.is_leader:
        return
    print_final_metrics(config.name, training.final_metrics)
    stdout.print(
        f"{summary['step']:,} steps, {summary['epochs']} epochs in {summary['seconds']:,.0f} s on {world.world_size} ranks; "
        f"rank 0: peak RSS {summary['peak_rss_mib']:,.0f} MiB, optimizer state on disk {summary['optimizer_state_on_disk_mib']:,.1f} MiB"
        f"\nrun folder: {top.path}",
        highlight=False,
        soft_wrap=True,
    )


def _rate(optimizer) -> str:
    """The learning rate and its schedule in a few words, for --dry-run."""
    lr, schedule, final = optimizer.lr, optimizer.schedule, optimizer.lr * optimizer.final_lr_ratio
    if schedule == "step":
        return f"lr {lr:g}, {final:g} after epoch {optimizer.decay_after_epochs}"
    if schedule in ("cosine", "linear"):
        return f"lr {lr:g}, {schedule} to {final:g}"
    if schedule == "plateau":
        return (
            f"lr {lr:g}, x{optimizer.plateau_factor:g} after {optimizer.plateau_patience + 1} evaluations without a "
            f"better one, down to {final:g}"
        )
    return f"lr {lr:g}"
