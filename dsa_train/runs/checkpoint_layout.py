"""The names of a run's checkpoint layout, spelled once.

:class:`~.checkpoint_store.CheckpointStore` owns the layout (its docstring draws it) and is
what reads, writes, prunes, cleans and reshards checkpoints; this module only names its parts,
so that the modules the store itself uses (the row writer, the optimizer's snapshot) can spell
them without importing the store.
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKPOINTS = "checkpoints"  # a run folder's checkpoints
TRAINER = "trainer.json"  # a checkpoint folder is complete when this is in it
CHECKPOINT_FORMAT = "dsa-train/checkpoint"  # what its trainer.json says it is
MODEL = "model.pt"
TABLES = "tables"  # the run's disk embedding tables (weights and moments): bases or deltas
PARTIAL = ".partial-"  # prefix of a checkpoint folder being written
DOOMED = ".deleting-"  # prefix of an old checkpoint folder being removed
RESTORING = ".restore-"  # prefix of a row file being restored (renamed into place when whole)
VERSION = 4  # 4: deltas on virtual bases; 3: row files as bases or deltas, ids and needs; 2: every file whole
READABLE = (2, 3, 4)  # a version 2 checkpoint is version 3 without deltas, 3 is 4 without virtual bases
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
