"""Checkpoints that are complete or absent, never half-written.

A checkpoint is built in ``checkpoints/.partial-<step>/`` (model weights, optimizer state,
``trainer.json``), every file fsynced, then renamed to ``checkpoints/<step>/`` and the parent
fsynced: the rename is the commit. ``--resume`` takes the newest ``<step>`` folder that has a
``trainer.json`` of a known format version; partial folders are removed on the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..errors import StateError
from ..fsutil import fsync_directory
from .optimizers import snapshot_optimizer
from .run_folder import PARTIAL, TRAINER, complete_checkpoints

FORMAT = "dsa-train/checkpoint"
VERSION = 1
MODEL = "model.pt"


def save_checkpoint(
    checkpoints: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer: dict, *, keep: int
) -> Path:
    checkpoints.mkdir(parents=True, exist_ok=True)
    for stale in checkpoints.glob(PARTIAL + "*"):  # left by a process killed mid-save
        shutil.rmtree(stale)
    final = checkpoints / f"{step:010d}"
    partial = checkpoints / f"{PARTIAL}{step:010d}"
    partial.mkdir()
    torch.save(model.state_dict(), partial / MODEL)
    snapshot_optimizer(optimizer, partial)
    (partial / TRAINER).write_text(json.dumps({"format": FORMAT, "version": VERSION, **trainer}, indent=2))
    for path in partial.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for directory in [p for p in partial.rglob("*") if p.is_dir()] + [partial]:
        fsync_directory(directory)
    if final.exists():  # the same step saved again (a resumed run reaching it): replace it
        shutil.rmtree(final)
    os.rename(partial, final)
    fsync_directory(checkpoints)
    for old in complete_checkpoints(checkpoints)[:-keep]:
        shutil.rmtree(old)
    return final


def checkpoint_at(checkpoints: Path, step: int | None) -> Path:
    """The checkpoint of ``step``, or the newest one."""
    found = complete_checkpoints(checkpoints)
    if not found:
        raise StateError(
            f"'{checkpoints}' holds no complete checkpoint",
            hint="train with train.checkpoint_every > 0, or let a run finish (it checkpoints at the end)",
        )
    if step is None:
        return found[-1]
    for path in found:
        if int(path.name) == step:
            return path
    raise StateError(
        f"no checkpoint of step {step} in '{checkpoints}'",
        hint=f"available steps: {', '.join(str(int(p.name)) for p in found)}",
    )


def read_trainer_state(checkpoint: Path) -> dict:
    try:
        state = json.loads((checkpoint / TRAINER).read_text())
    except (OSError, ValueError) as e:
        raise StateError(f"checkpoint '{checkpoint}' is unreadable: {e}", hint="resume from an older checkpoint") from None
    if state.get("format") != FORMAT or state.get("version") != VERSION:
        raise StateError(
            f"checkpoint '{checkpoint}' has format {state.get('format')!r} version {state.get('version')!r}, "
            f"this dsa-train reads {FORMAT!r} version {VERSION}",
            hint="resume it with the dsa-train version that wrote it",
        )
    return state


def load_model_state(checkpoint: Path, model: torch.nn.Module) -> None:
    model.load_state_dict(torch.load(checkpoint / MODEL, map_location="cpu", weights_only=True))
