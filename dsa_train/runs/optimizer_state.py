"""The recipe's optimizer: DiskSparseAdam or torch's SparseAdam, and how each is checkpointed.

DiskSparseAdam's moments live in the run's ``optimizer_state/``: a checkpoint writes the
manifest a flush would commit and hands each row file to the checkpoint's row writer (a base
copy, or a delta of the rows written since the previous checkpoint, taken from the rows as the
optimizer holds them, the live files left unflushed: see checkpoint_rows.py), and a resume
writes each one back (base and deltas, under a temporary name, renamed into place) before the
optimizer opens it. The optimizer's dirty rows then count from that checkpoint. SparseAdam's moments are tensors: they go into ``optimizer.pt``, read back with
``weights_only=True`` (a checkpoint never runs code). Before a resume replaces the live
directory, it proves that directory is this run's: its manifest names a state id the run
recorded (or the checkpoint's copy has); only the files that manifest lists are replaced.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import StateError
from ..fsutil import DirectoryLock, fsync_directory, is_regular_file, lock_holder, temporary_prefix
from ..optim import DiskSparseAdam
from ..storage.deltas import DELTA_SUFFIX, chain_of, materialise
from ..storage.format import MANIFEST, PENDING_SUFFIX, ROWS_SUFFIX, TABLE_LAYOUT, load_manifest
from ..recipe import OptimizerConfig
from .checkpoint_layout import RESTORING
from .run_folder import STATE_DIR

STATE_COPY = STATE_DIR  # a checkpoint's copy of the state has the live directory's name
STATE_DICT = "optimizer.pt"


def build_optimizer(
    config: OptimizerConfig, named_parameters: list[tuple[str, torch.Tensor]], state_dir: Path
) -> torch.optim.Optimizer:
    """The recipe's optimizer for sparse embedding tables (named, so DiskSparseAdam names its files)."""
    kwargs = dict(lr=config.lr, betas=config.betas, eps=config.eps)
    if config.kind == "dsa":
        return DiskSparseAdam(
            named_parameters,
            state_dir=state_dir,
            nonfinite=config.nonfinite,
            first_moment=config.first_moment,
            second_moment=config.second_moment,
            memory_budget=config.memory_budget,
            **kwargs,
        )
    return torch.optim.SparseAdam([p for _, p in named_parameters], **kwargs)


def snapshot_optimizer(
    optimizer: torch.optim.Optimizer, target: Path, write_rows: Callable[[Path, str], None], manifest: bytes | None
) -> None:
    """Write the optimizer's complete state into the checkpoint folder ``target``;
    ``write_rows(source, name)`` writes a row file as ``target/name`` (a base or a delta, from
    the rows as the optimizer holds them), ``manifest`` is DiskSparseAdam's
    :meth:`~dsa_train.optim.DiskSparseAdam.snapshot_manifest`. Nothing is flushed: the live
    state directory stays as it was. The manifest's copy and ``optimizer.pt`` are not fsynced
    here: the caller fsyncs every file it commits."""
    if isinstance(optimizer, DiskSparseAdam):
        copy = target / STATE_COPY
        copy.mkdir(exist_ok=True)
        for source in owned_state_files(optimizer.state_dir, {optimizer.state_id}):
            if source.name.startswith(RESTORING):
                continue  # a killed restore's leftover, never part of the state
            if source.name == MANIFEST:
                _write_new(copy / MANIFEST, manifest)
            else:
                write_rows(source, f"{STATE_COPY}/{source.name}")
    torch.save(optimizer.state_dict(), target / STATE_DICT)


def _write_new(target: Path, data: bytes) -> None:
    """Write a small file at ``target`` (new, never through a link), without an fsync."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def restore_state_dir(checkpoint: Path | None, state_dir: Path, *, owned: set[str | None] = frozenset()) -> None:
    """Make the live state directory the checkpoint's copy again (before the optimizer opens
    it), or empty it when there is no checkpoint: what is there came after the checkpoint.

    ``owned``: the state ids the run recorded as its own. The directory is changed only if it
    is empty or its manifest names one of them (or the checkpoint copy's id); a directory of
    someone else's files is refused before anything in it is touched.
    """
    copy = checkpoint / STATE_COPY if checkpoint is not None else None
    ids = {i for i in owned if i}
    if copy is not None and copy.is_dir():
        ids.add(load_manifest(copy / MANIFEST)["state_id"])
    if not state_dir.exists():
        stale = []
    else:
        holder = lock_holder(state_dir)
        if holder:
            raise StateError(
                f"optimizer state directory '{state_dir}' is in use by {holder}",
                hint="another training uses it: stop that one, or give this run its own optimizer.state_dir",
            )
        stale = owned_state_files(state_dir, ids)
    has_copy = copy is not None and copy.is_dir()
    if not stale and not has_copy:
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = DirectoryLock(state_dir, purpose="optimizer state directory")
    lock.acquire()  # no optimizer may open it while its files are replaced
    try:
        # Each file is replaced whole (written under a temporary name, renamed), row files
        # first and the manifest last, and stale files are removed after, the manifest last:
        # a kill anywhere leaves a manifest that proves the directory is the run's.
        restored = set()
        for source in sorted(owned_state_files(copy, ids), key=lambda p: p.name == MANIFEST) if has_copy else ():
            name = source.name.removesuffix(DELTA_SUFFIX)
            scratch = state_dir / f"{RESTORING}{uuid.uuid4().hex[:12]}-{name}"
            try:
                materialise(chain_of(source), scratch)
                os.replace(scratch, state_dir / name)
            except BaseException:
                scratch.unlink(missing_ok=True)
                raise
            restored.add(name)
        for path in sorted(stale, key=lambda p: p.name == MANIFEST):
            if path.name not in restored:
                path.unlink(missing_ok=True)
        fsync_directory(state_dir)
    finally:
        lock.release()


def owned_state_files(directory: Path, ids: set[str]) -> list[Path]:
    """The manifest and the row files it lists in ``directory``, after proving the directory
    holds the state with one of the ``ids``; ``[]`` for an empty directory. A ``StateError``,
    before anything is changed, for a directory that holds anything else."""
    directory = Path(directory)
    leftovers = (RESTORING, temporary_prefix(MANIFEST))  # a killed restore's, a killed first manifest write's
    ours = [p for p in directory.iterdir() if p.name.startswith(leftovers) and is_regular_file(p)]
    names = {p.name for p in directory.iterdir() if not p.name.startswith(DirectoryLock.FILE_NAME)} - {
        p.name for p in ours
    }
    if not names:
        return ours

    def refuse(why: str) -> StateError:
        return StateError(
            f"optimizer state directory '{directory}' {why}; nothing in it was changed",
            hint="point optimizer.state_dir at this run's state directory, an empty folder or a new path",
        )

    manifest_path = directory / MANIFEST
    if manifest_path.is_symlink() or not manifest_path.is_file():
        raise refuse(f"holds files ({', '.join(sorted(names)[:3])}) but no {MANIFEST} of a DiskSparseAdam state")
    try:
        manifest = load_manifest(manifest_path)
    except StateError as e:
        raise refuse(f"does not hold a DiskSparseAdam state this run can prove is its own ({e.message})") from None
    if manifest["state_id"] not in ids:
        raise refuse(
            f"holds the optimizer state {manifest['state_id']}, not this run's ({', '.join(sorted(ids)) or 'none recorded'})"
        )
    files = [manifest_path, *ours]
    for entry in manifest["params"].values():
        if entry.get("layout") == TABLE_LAYOUT:
            continue  # the moments live in the run's disk table, restored with the tables
        pending = entry["file"].removesuffix(ROWS_SUFFIX) + PENDING_SUFFIX
        for name in (entry["file"], pending, entry["file"] + DELTA_SUFFIX):  # a delta: in a checkpoint's copy
            path = directory / name
            if path.is_symlink() or (path.exists() and not path.is_file()):
                raise refuse(f"has '{name}' as a link or a folder, not the row file its manifest lists")
            if path.is_file():
                files.append(path)
    return files


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, checkpoint: Path, config: OptimizerConfig | None = None
) -> None:
    """Load the checkpoint's step counters into an optimizer opened on the state the
    checkpoint was restored into. Given the recipe's ``config``, its hyper-parameters (``lr``,
    ``betas``, ``eps``) replace the checkpoint's: a resumed run's ``--set optimizer.lr=...``
    applies from its next step, as its config.yaml says. (The checkpoint store then counts
    DiskSparseAdam's dirty rows from that checkpoint: CheckpointStore.count_from_checkpoint.)"""
    state = load_tensors(checkpoint / STATE_DICT)
    for group in state.get("param_groups", []) if config is not None and isinstance(state, dict) else []:
        group.update(lr=config.lr, betas=tuple(config.betas), eps=config.eps)
    optimizer.load_state_dict(state)


def flush_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Write DiskSparseAdam's changed rows to its live files now (checkpoints leave them in
    memory; ``close()`` would write them next): what a run's summary measures on disk."""
    if isinstance(optimizer, DiskSparseAdam):
        optimizer.flush()


def close_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer, DiskSparseAdam):
        optimizer.close()


def load_tensors(path: Path):
    """A checkpoint's torch file, read with ``weights_only=True``: tensors and plain containers
    only, so a tampered file can never run code; anything else is a ``StateError``."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise StateError(
            f"checkpoint file '{path}' holds something other than tensors and plain values, or is damaged "
            f"({first}); it was not loaded, so nothing in it ran",
            hint="resume from another checkpoint; never load a checkpoint you did not write",
        ) from None
