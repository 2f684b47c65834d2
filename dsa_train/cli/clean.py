"""``dsa-train clean``: remove old checkpoints and optimizer state, showing what it frees."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.table import Table

from ..errors import DsaError
from ..runs.cleanup import is_state_dir, parse_age, plan_clean, remove
from ..memory import human_bytes
from ._errors import handle_errors
from ._output import stderr, stdout


def _default_paths() -> list[Path]:
    """./runs and the state directories directly in the current directory."""
    here = Path.cwd()
    paths = [here / "runs"] if (here / "runs").is_dir() else []
    return paths + [p for p in sorted(here.iterdir()) if p.is_dir() and not p.is_symlink() and is_state_dir(p)]


@handle_errors
def clean(
    paths: list[Path] = typer.Argument(
        None,
        metavar="PATH",
        help="Run folders, state directories, or folders holding them. Default: ./runs and state directories in .",
        show_default=False,
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan and remove nothing."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Remove without asking."),
    keep_last: int = typer.Option(
        1,
        "--keep-last",
        min=0,
        help="Complete checkpoints kept per run (0 removes them all); in a torchrun job, its newest complete steps, in every rank.",
    ),
    older_than: str | None = typer.Option(
        None, "--older-than", help="Only what is older than this: 90s, 30m, 12h, 7d, 2w.", show_default=False
    ),
) -> None:
    """Remove old checkpoints, unfinished checkpoints and unused optimizer state.

    Removes only what it recognises (a checkpoint's trainer.json, a state directory's
    manifest), never follows symbolic links, never touches a directory a live process holds,
    and keeps each run's newest checkpoint unless --keep-last 0.

    In a torchrun job's run folder, each rank's folder (ranks/<rank>-of-<world>/) is cleaned
    as a run, and a step counts as complete only once the job's checkpoints.json lists it:
    every rank keeps the --keep-last newest listed steps, and any newer step (one not every
    rank may have finished). Without that file (it is on rank 0's machine), or when it does
    not match the rank folders, every rank's checkpoints are kept. A linked rank folder is
    never entered.

    Examples:

      dsa-train clean --dry-run

      dsa-train clean runs/ ./opt_state_cache --older-than 7d --yes
    """
    age = parse_age(older_than) if older_than else None
    targets = list(paths) if paths else _default_paths()
    if not targets:
        stdout.print("Nothing to clean: no runs/ folder or state directory here.")
        return
    plan = plan_clean(targets, keep_last=keep_last, older_than=age)
    for path, why in plan.kept:
        stderr.print(f"keeping {_shown(path)}: {why}", highlight=False, soft_wrap=True)
    if not plan.candidates:
        stdout.print("Nothing to clean.")
        return
    table = Table(title=f"dsa-train clean: {len(plan.candidates)} to remove, {human_bytes(plan.bytes)} freed")
    for column in ("what", "path", "size", "age"):  # a path in a removal plan is never cut short
        table.add_column(column, justify="right" if column in ("size", "age") else "left", overflow="fold")
    now = time.time()
    for c in plan.candidates:
        table.add_row(c.kind, _shown(c.path), human_bytes(c.bytes), _age(now - c.modified))
    stdout.print(table)
    if dry_run:
        stdout.print("Dry run: nothing removed.")
        return
    if not yes and not can_ask():  # a script or a pipe: no one to answer the question
        raise DsaError(
            f"clean would remove the {len(plan.candidates)} items above, but there is no terminal to confirm it on",
            hint="pass --yes to remove them without asking (or --dry-run to only list them)",
        )
    if not yes and not typer.confirm(f"Remove these {len(plan.candidates)} items?", default=False, err=True):
        stdout.print("Cancelled: nothing removed.")
        return
    freed = 0
    for candidate in plan.candidates:
        try:
            remove(candidate)
            freed += candidate.bytes
        except DsaError as e:
            stderr.print(str(e), highlight=False, soft_wrap=True)
    stdout.print(f"Removed {sum(1 for c in plan.candidates if not c.path.exists())} items, freed {human_bytes(freed)}.")


def can_ask() -> bool:
    """Whether someone can answer a question: stdin is a terminal."""
    return sys.stdin.isatty()


def _shown(path: Path) -> str:
    """The path relative to the working directory when it is below it."""
    absolute = path.absolute()
    return str(absolute.relative_to(Path.cwd())) if absolute.is_relative_to(Path.cwd()) else str(path)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
