"""The disk layout of a run's checkpoints: every name and prefix, and which checkpoints stay.

Everything that reads, writes, prunes, cleans or reshards checkpoints asks this module what a
name is (PyTorch-BigGraph's ``checkpoint_storage.py`` keeps its layout in one place likewise)::

    <run>/checkpoints/                CHECKPOINTS
      0000000200/                     a complete checkpoint of step 200: step_name(200)
        trainer.json                  TRAINER, written last: the folder counts once it is there
        model.pt                      MODEL
        tables/<name>.table           TABLES: the disk tables, each a base or a delta
        optimizer_state/, optimizer.pt   the optimizer's (see optimizers.py)
      .partial-0000000400/            PARTIAL: being written, renamed to 0000000400 when whole
      .deleting-0000000100/           DOOMED: renamed so, then removed
    .restore-<id>-<file>              RESTORING: a row file being restored beside its target

A checkpoint whose row files are deltas names, in ``trainer.json``'s ``needs``, the earlier
checkpoints its chains apply to; :func:`retained` keeps them with it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..fsutil import is_regular_file, read_json_object

CHECKPOINTS = "checkpoints"  # a run folder's checkpoints
TRAINER = "trainer.json"  # a checkpoint folder is complete when this is in it (checkpoint.py)
CHECKPOINT_FORMAT = "dsa-train/checkpoint"  # what its trainer.json says it is
MODEL = "model.pt"
TABLES = "tables"  # the run's disk embedding tables (weights and moments): bases or deltas
PARTIAL = ".partial-"  # prefix of a checkpoint folder being written
DOOMED = ".deleting-"  # prefix of an old checkpoint folder being removed
RESTORING = ".restore-"  # prefix of a row file being restored (renamed into place when whole)
STEP_DIGITS = 10  # a step folder's name: the step, zero-padded, so names sort as steps do


def step_name(step: int) -> str:
    """The folder name of step ``step``'s checkpoint."""
    return f"{step:0{STEP_DIGITS}d}"


def is_step_name(name: str) -> bool:
    """Whether ``name`` names a step folder (of any width: older runs' too)."""
    return name.isdigit()


def real_directories(folder: Path) -> list[Path]:
    """The sub-folders of ``folder`` that are real directories (links are never entered)."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))


def scratch_folders(checkpoints: Path) -> list[Path]:
    """Checkpoint folders a killed save or prune left behind (never complete checkpoints)."""
    if checkpoints.is_symlink():
        return []
    return [p for p in real_directories(checkpoints) if p.name.startswith((PARTIAL, DOOMED))]


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """Committed checkpoints, oldest first."""
    if checkpoints.is_symlink():
        return []
    return [p for p in real_directories(checkpoints) if is_step_name(p.name) and is_regular_file(p / TRAINER)]


def checkpoint_needs(checkpoint: Path) -> list[str]:
    """The earlier checkpoints (folder names) whose files this one's deltas are applied to:
    its ``trainer.json``'s ``needs``, read without following a link (``[]`` when it has none,
    or none that is readable). Pruning and ``clean`` never remove a checkpoint a kept one needs."""
    state = read_json_object(Path(checkpoint) / TRAINER)
    needs = state.get("needs") if state and state.get("format") == CHECKPOINT_FORMAT else None
    return [n for n in needs if isinstance(n, str) and is_step_name(n)] if isinstance(needs, list) else []


def retained(complete: list[Path], keep: int, *, held: dict[Path, str] | None = None) -> dict[Path, str]:
    """Which of a run's ``complete`` checkpoints (oldest first) stay, each with why: those
    ``held`` (with their reasons), the newest ``keep``, and every checkpoint a kept one is made
    of (its ``needs``, which list a delta chain whole). The one rule for pruning after a save
    and for ``dsa-train clean``."""
    why = dict(held or {})
    for checkpoint in complete[-keep:] if keep else []:
        why.setdefault(checkpoint, f"one of the newest {keep} checkpoints")
    for kept in list(why):
        for name in checkpoint_needs(kept):
            why.setdefault(kept.parent / name, f"checkpoint {kept.name} is made of its deltas on this one: kept with it")
    return why
