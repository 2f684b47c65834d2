"""Checkpoints that are complete or absent, never half-written, and checked when read.

A checkpoint is built in ``checkpoints/.partial-<step>/`` (model weights, copies of the disk
tables, optimizer state, ``trainer.json``), every file fsynced, then renamed to ``checkpoints/<step>/`` and the parent
fsynced: the rename is the commit. ``trainer.json`` carries the format version, the id of
the run it belongs to, a digest of every other file (see :func:`~dsa_train.fsutil.file_digest`)
and a checksum of its own content; a checkpoint whose files do not match them (torn,
truncated, bit-flipped, edited), that holds a file it does not list, or a symbolic link, is
reported and passed over for the previous intact one. Nothing in a checkpoint is unpickled:
torch files are read with ``weights_only=True`` (tensors and plain containers only), the
rest is JSON. Old checkpoints are renamed to ``.deleting-<step>`` before they are removed, so a
kill mid-removal never leaves a "complete" checkpoint with files missing. A full disk during
a save removes the partial folder and raises a ``StateError``; earlier checkpoints stay.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import torch

from ..errors import StateError
from ..fsutil import copy_sparse, file_digest, fsync_directory
from ..nn import DiskTable
from ..optim.format import TABLE_LAYOUT, read_row_header
from ..optim.format import manifest_checksum as trainer_checksum  # one canonical-JSON checksum for both
from .optimizers import load_tensors, snapshot_optimizer
from .run_folder import CHECKPOINT_FORMAT as FORMAT
from .run_folder import DOOMED, PARTIAL, TRAINER, complete_checkpoints, scratch_folders

VERSION = 2  # 2: trainer.json checksummed, every file listed, run id; nothing unpickled
MODEL = "model.pt"
TABLES = "tables"  # copies of the run's disk embedding tables (weights and moments)


def save_checkpoint(
    checkpoints: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer: dict,
    *,
    keep: int,
    extra: dict[str, object] | None = None,
) -> Path:
    """Commit a checkpoint of ``step``; ``extra`` maps file names to more objects to ``torch.save``."""
    checkpoints.mkdir(parents=True, exist_ok=True)
    for stale in scratch_folders(checkpoints):  # left by a process killed mid-save or mid-prune
        shutil.rmtree(stale)
    final = checkpoints / f"{step:010d}"
    partial = checkpoints / f"{PARTIAL}{step:010d}"
    try:
        _write(partial, model, optimizer, trainer, extra or {})
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StateError(
                f"the disk is full: checkpoint of step {step} could not be written in '{checkpoints}'",
                hint="free some space and run again with --resume; the previous checkpoints are intact",
            ) from None
        raise
    if final.exists():  # the same step saved again (a resumed run reaching it): replace it
        shutil.rmtree(final)
    os.rename(partial, final)
    fsync_directory(checkpoints)
    for old in complete_checkpoints(checkpoints)[:-keep]:
        doomed = old.with_name(DOOMED + old.name)
        os.rename(old, doomed)  # no longer complete the moment removal starts
        shutil.rmtree(doomed)
    return final


def _write(partial: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer: dict, extra: dict) -> None:
    partial.mkdir()
    torch.save(model.state_dict(), partial / MODEL)  # a disk table's entry is a reference...
    for module in model.modules():  # ...and its file (weights and moments) is copied
        if isinstance(module, DiskTable):
            module.flush()
            (partial / TABLES).mkdir(exist_ok=True)
            copy_sparse(module.path, partial / TABLES / module.path.name)
    snapshot_optimizer(optimizer, partial)
    for name, obj in extra.items():
        torch.save(obj, partial / name)
    files = sorted(p for p in partial.rglob("*") if p.is_file())
    for path in files:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    digests = {str(p.relative_to(partial)): file_digest(p) for p in files}
    state = {"format": FORMAT, "version": VERSION, **trainer, "files": digests}
    with open(partial / TRAINER, "w") as f:
        f.write(json.dumps({**state, "checksum": trainer_checksum(state)}, indent=2))
        f.flush()
        os.fsync(f.fileno())
    for directory in [p for p in partial.rglob("*") if p.is_dir()] + [partial]:
        fsync_directory(directory)


def read_trainer_state(checkpoint: Path) -> dict:
    try:
        state = json.loads((checkpoint / TRAINER).read_bytes())
    except (OSError, ValueError) as e:
        raise StateError(f"checkpoint '{checkpoint}' is unreadable: {e}", hint="resume from an older checkpoint") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") != VERSION:
        found = (state.get("format"), state.get("version")) if isinstance(state, dict) else (None, None)
        raise StateError(
            f"checkpoint '{checkpoint}' has format {found[0]!r} version {found[1]!r}, "
            f"this dsa-train reads {FORMAT!r} version {VERSION}",
            hint="resume it with the dsa-train version that wrote it",
        )
    if state.get("checksum") != trainer_checksum(state):
        raise StateError(
            f"checkpoint '{checkpoint}' is damaged: {TRAINER} does not match its checksum (edited or corrupted)",
            hint="resume from an older checkpoint",
        )
    return state


def verify_checkpoint(checkpoint: Path) -> dict:
    """The trainer state of an intact checkpoint; a ``StateError`` names what is damaged."""
    state = read_trainer_state(checkpoint)
    files = state.get("files")
    if not isinstance(files, dict) or not files:
        raise StateError(f"checkpoint '{checkpoint}' lists no file digests", hint="resume from an older checkpoint")
    found = _files_in(checkpoint)
    for name, expected in files.items():
        path = checkpoint / name
        if name not in found:
            raise StateError(f"checkpoint '{checkpoint}' lacks {name}", hint="resume from an older checkpoint")
        if file_digest(path) != expected:
            raise StateError(
                f"checkpoint '{checkpoint}' is damaged: {name} does not match its digest (torn, truncated or changed)",
                hint="resume from an older checkpoint",
            )
    unlisted = sorted(set(found) - set(files) - {TRAINER})
    if unlisted:
        raise StateError(
            f"checkpoint '{checkpoint}' holds {', '.join(unlisted[:3])}, which its {TRAINER} does not list "
            "(added behind its back, or a link)",
            hint="remove what was added, or resume from an older checkpoint",
        )
    return state


def _files_in(folder: Path) -> set[str]:
    """Relative names of every entry below ``folder`` that is not a real directory; links are
    listed (and so refused by the caller) but never followed."""
    names = set()
    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            names |= {f"{entry.name}/{name}" for name in _files_in(Path(entry.path))}
        elif entry.is_symlink() or not stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
            names.add(f"{entry.name} (a link or special file)")
        else:
            names.add(entry.name)
    return names


def find_checkpoint(checkpoints: Path, step: int | None = None) -> tuple[Path, dict, list[str]]:
    """The checkpoint of ``step`` (else the newest intact one), its trainer state, and a warning
    for each newer checkpoint passed over as damaged."""
    found = complete_checkpoints(checkpoints)
    if not found:
        raise StateError(
            f"'{checkpoints}' holds no complete checkpoint",
            hint="train with train.checkpoint_every > 0, or let a run finish (it checkpoints at the end)",
        )
    if step is not None:
        for path in found:
            if int(path.name) == step:
                return path, verify_checkpoint(path), []
        raise StateError(
            f"no checkpoint of step {step} in '{checkpoints}'",
            hint=f"available steps: {', '.join(str(int(p.name)) for p in found)}",
        )
    warnings = []
    for path in reversed(found):
        try:
            return path, verify_checkpoint(path), warnings
        except StateError as e:
            warnings.append(f"{e.message}; using an older checkpoint")
    raise StateError(
        f"every checkpoint in '{checkpoints}' is damaged:\n  " + "\n  ".join(warnings),
        hint="start the run again without --resume",
    )


def restore_tables(checkpoint: Path | None, tables: Path) -> None:
    """Make the run's disk tables the checkpoint's copies again (or remove them, without one).

    Only regular files that carry a table header are removed; anything else in the folder is
    a stranger and stops the restore before anything changes.
    """
    stale = []
    for entry in os.scandir(tables) if tables.is_dir() else ():
        path = Path(entry.path)
        if entry.name.endswith(".table") and entry.is_file(follow_symlinks=False) and is_table_file(path):
            stale.append(path)
        elif not entry.name.startswith("."):
            raise StateError(
                f"'{path}' in the run's table folder is not a dsa-train table; nothing was changed",
                hint="move it out of the run folder and resume again",
            )
    for path in stale:
        path.unlink()
    copies = checkpoint / TABLES if checkpoint is not None else None
    if copies is None or not copies.is_dir():
        return
    tables.mkdir(parents=True, exist_ok=True)
    for source in sorted(copies.glob("*.table")):
        copy_sparse(source, tables / source.name)
    fsync_directory(tables)


def is_table_file(path: Path) -> bool:
    try:
        return read_row_header(path).get("layout") == TABLE_LAYOUT
    except StateError:
        return False


def load_model_state(checkpoint: Path, model: torch.nn.Module) -> None:
    model.load_state_dict(load_tensors(checkpoint / MODEL))

