"""``dsa-train tune``: search a recipe's settings on the valid split (Optuna), see docs/tune.md."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import time
from pathlib import Path

import typer
from rich.table import Table

from ..errors import DsaError
from ..recipe import load_recipe, recipe_differences, with_data_root
from ._errors import handle_errors
from ._output import command_output, metrics_table, stderr, stdout
from ._imports import import_recipe_data
from ..recipe.find import find_recipe
from ..tune.budget import TRIALS_IN_BUDGET, trial_share

UNITS = {"s": 1, "m": 60, "h": 3600}
PR_SET_PDEATHSIG = 1  # prctl: a signal to this process when its parent dies


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``1.5h`` -> seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", text or "")
    if match is None or float(match[1]) <= 0:
        raise DsaError(
            f"--timeout {text!r} is not a duration", hint="write it as seconds or with a unit: 90s, 30m, 1.5h"
        )
    return float(match[1]) * UNITS[match[2] or "s"]


@handle_errors
@command_output(shown=False)  # the trials' own messages are not shown: each trial is one line
def tune(
    recipe: Path = typer.Argument(
        ..., help="The recipe to tune: a YAML file, or a shipped recipe's name.", show_default=False
    ),
    output: Path | None = typer.Option(
        None,
        "--output",
        "-o",
        help="The tune folder. Default: <output.dir>/<recipe name>-tune-<timestamp>.",
        show_default=False,
    ),
    trials: int | None = typer.Option(
        None,
        "--trials",
        min=1,
        help="Stop after this many trials (all jobs together; with --resume, counting those done).",
        show_default=False,
    ),
    timeout: str | None = typer.Option(
        None,
        "--timeout",
        help="Start no trial after this long (90s, 30m, 2h); the trials under way finish.",
        show_default=False,
    ),
    jobs: int = typer.Option(
        1, "--jobs", min=1, help="Worker processes sharing the study; each gets cores / jobs torch threads."
    ),
    space: Path | None = typer.Option(
        None,
        "--space",
        metavar="FILE",
        help="The search space (YAML, recipe keys to ranges or choices). Default: per model kind.",
        show_default=False,
    ),
    set_: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        help="Override a recipe key before the search, e.g. --set train.epochs=20 (repeatable).",
        show_default=False,
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the search in --output: its trials are kept, those a kill cut short run again.",
    ),
) -> None:
    """Search a recipe's settings on the valid split; writes best.yaml, the trials table and the best model's test metrics.

    Examples:

      dsa-train tune recipes/umls-transe.yaml -o tunes/umls --timeout 30m

      dsa-train tune quickstart --trials 20 --jobs 2 --space my-space.yaml

      dsa-train tune recipes/umls-transe.yaml -o tunes/umls --resume --timeout 10m

      dsa-train run tunes/umls/best.yaml
    """
    from ..tune.space import default_space, load_space
    from ..tune.study import TuneFolder

    if trials is None and timeout is None:
        raise DsaError(
            "a search needs an end: --trials N, --timeout 30m, or both", hint="e.g. dsa-train tune RECIPE --timeout 30m"
        )
    seconds = parse_duration(timeout) if timeout is not None else None
    base = with_data_root(load_recipe(find_recipe(recipe), list(set_)))
    if resume:
        if output is None:
            raise DsaError(
                "--resume continues a tune folder: pass it with -o",
                hint="e.g. dsa-train tune RECIPE -o tunes/umls --resume",
            )
        folder = TuneFolder.find(output)
        folder.lock()
        stored = folder.base()
        changed = recipe_differences(stored, base)
        if changed or space is not None:
            stderr.print(
                "the tune folder's recipe and space win over "
                + (
                    "; ".join(f"{key} ({ours!r} there, {theirs!r} given)" for key, ours, theirs in changed[:5])
                    or "the given ones"
                )
                + " (start a new tune to search another recipe or space)",
                highlight=False,
            )
        requeued = folder.requeue_unfinished()
        if requeued:
            stderr.print(f"{requeued} trial(s) cut short by the kill run again with the same settings", highlight=False)
    else:
        searched = load_space(space, base) if space is not None else default_space(base)
        where = output or Path(base.output.dir) / f"{base.name}-tune-{time.strftime('%Y%m%d-%H%M%S')}"
        folder = TuneFolder.create(base, searched, where)
    try:
        stderr.print(f"tune folder: {folder.path}; searching {', '.join(folder.space())}", highlight=False)
        deadline = time.time() + seconds if seconds is not None else None
        share = trial_share(seconds, trials, jobs)
        if share is not None:
            stderr.print(
                f"each trial trains at most {share / 60:,.1f} minutes (--timeout over "
                f"{trials or TRIALS_IN_BUDGET} trials, {jobs} at a time): one that would run longer ends at the epoch before",
                highlight=False,
            )
        if jobs == 1:
            _search(str(folder.path), trials, deadline, share, 0, 1)
        else:
            import_recipe_data(
                folder.base()
            )  # once, here: the workers would race to import it, and all but one be refused
            _spawn(folder.path, trials, deadline, share, jobs)
        _report(folder)
    finally:
        folder.release()


def _search(path: str, trials: int | None, deadline: float | None, share: float | None, worker: int, jobs: int) -> None:
    """One worker: trials until the study has enough or the deadline passed."""
    from ..tune.study import TuneFolder, search

    if jobs > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))
    search(
        TuneFolder(Path(path)),
        trials=trials,
        deadline=deadline,
        trial_seconds=share,
        worker=worker,
        report=_print_trial,
    )


def _worker(path: str, trials: int | None, deadline: float | None, share: float | None, worker: int, jobs: int) -> None:
    """A worker process's main: dies with its parent (a killed tune leaves no orphans), ends on
    an error with one line, as the CLI does."""
    from ..fsutil import libc

    libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        with command_output(shown=False):
            _search(path, trials, deadline, share, worker, jobs)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except DsaError as e:
        stderr.print(f"worker {worker}: Error: {e.message}" + (f"\nHint: {e.hint}" if e.hint else ""), highlight=False)
        raise SystemExit(1) from None


def _spawn(path: Path, trials: int | None, deadline: float | None, share: float | None, jobs: int) -> None:
    context = multiprocessing.get_context("spawn")  # fresh interpreters: torch's threads and locks are not forked
    workers = [
        context.Process(
            target=_worker, args=(str(path), trials, deadline, share, i, jobs), name=f"dsa-train tune worker {i}"
        )
        for i in range(jobs)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    failed = [i for i, w in enumerate(workers) if w.exitcode != 0]
    if failed:
        interrupted = all(workers[i].exitcode in (130, -signal.SIGINT) for i in failed)
        if interrupted:
            raise KeyboardInterrupt
        raise DsaError(
            f"worker{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of {jobs} stopped with an error (above)",
            hint=f"fix it and continue the search with: dsa-train tune RECIPE -o {path} --resume",
        )


def _print_trial(result) -> None:
    settings = ", ".join(f"{key.rsplit('.', 1)[-1]}={_short(value)}" for key, value in result.values.items())
    if result.state == "COMPLETE":
        outcome = f"{result.label} {result.value:.4f}"
    elif result.state == "PRUNED":
        outcome = f"pruned at epoch {result.epoch} ({result.label} {result.value:.4f})"
    else:
        outcome = f"failed: {result.error}"
    stderr.print(
        f"trial {result.number}: {outcome} in {result.seconds:.0f} s ({settings})", highlight=False, soft_wrap=True
    )


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _report(folder) -> None:
    from ..tune.study import TuneFolder, best_test, write_results

    found, best = write_results(folder)
    table = Table(title=f"trials ({folder.path / TuneFolder.TABLE})")
    keys = list(dict.fromkeys(k for r in found for k in r.params))
    for column in ("trial", "state", best.metric, "epoch", "seconds", *(k.rsplit(".", 1)[-1] for k in keys)):
        table.add_column(
            column, justify="left" if column == "state" else "right", no_wrap=column in ("trial", "state", best.metric)
        )
    for r in found:
        table.add_row(
            str(r.number),
            r.state,
            "" if r.value is None else f"{r.value:.4f}",
            "" if r.epoch is None else str(r.epoch),
            "" if r.seconds is None else f"{r.seconds:.0f}",
            *(_short(r.params[k]) if k in r.params else "" for k in keys),
        )
    stdout.print(table)
    counts = {s: sum(r.state == s for r in found) for s in ("COMPLETE", "PRUNED", "FAIL", "KILLED")}
    stdout.print(", ".join(f"{n} {s.lower()}" for s, n in counts.items() if n), highlight=False)
    stdout.print(
        f"best: trial {best.number}, {best.metric} {best.value:.4f}; its recipe: {folder.path / TuneFolder.BEST}",
        highlight=False,
        soft_wrap=True,
    )
    record = best_test(folder, best)
    stdout.print(metrics_table(f"best trial {best.number}: test", record["test"]))
    stdout.print(
        f"test metrics kept in {folder.path / TuneFolder.BEST_TEST}; train it again with: dsa-train run {folder.path / TuneFolder.BEST}",
        highlight=False,
        soft_wrap=True,
    )
