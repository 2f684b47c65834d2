"""A run's checkpoints, owned by one class: :class:`CheckpointStore`.

Checkpoints are complete or absent, never half-written, and checked when read. Everything
that saves, finds, verifies, restores, prunes, cleans or reshards checkpoints asks the store
(PyTorch-BigGraph's ``checkpoint_storage.py`` keeps its layout behind one class likewise); the
names it uses are spelled once, in :mod:`.checkpoint_layout`, and how a checkpoint's files are
written (row files as bases or deltas) is :mod:`.checkpoint_rows`'. Importing this module
loads no torch (``dsa-train clean`` and ``inspect-state`` list checkpoints without it): what
saves or loads tensors imports :mod:`.checkpoint_rows` on first use.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StateError
from ..fsutil import file_digest, fsync_directory, is_regular_file, read_json_object
from ..storage.deltas import DELTA_SUFFIX, chain_of, is_virtual, materialise, read_delta_header
from ..storage.format import TABLE_LAYOUT, read_row_header
from ..storage.format import manifest_checksum as trainer_checksum  # one canonical-JSON checksum for both
from .checkpoint_layout import CHECKPOINT_FORMAT as FORMAT
from .checkpoint_layout import (
    CHECKPOINTS,
    DOOMED,
    MODEL,
    PARTIAL,
    READABLE,
    RESTORING,
    TABLES,
    TRAINER,
    is_step_name,
    real_directories,
    step_name,
)

if TYPE_CHECKING:
    import torch

    from ..nn import ChainEmbedding


class CheckpointStore:
    """The checkpoints of one run, in its ``checkpoints/`` folder::

        <run>/checkpoints/                the store's folder (CHECKPOINTS)
          0000000200/                     a complete checkpoint of step 200: get_checkpoint_dir(200)
            trainer.json                  get_trainer_file: written last, the folder counts once it is there
            model.pt                      get_model_file
            tables/<name>.table[.delta]   get_tables_dir: the disk tables, each a base or a delta
            optimizer_state/, optimizer.pt   the optimizer's (see optimizers.py)
          .partial-0000000400/            get_partial_dir(400): being written, renamed to 0000000400 when whole
          .deleting-0000000100/           get_doomed_dir: renamed so, then removed
        .restore-<id>-<file>              RESTORING: a row file being restored beside its target

    A checkpoint is built in its partial folder (model weights, the disk tables, the optimizer
    state, ``trainer.json``), every file fsynced, then renamed to its step folder and the
    folder fsynced: the rename is the commit. ``trainer.json`` carries the format version, the
    id of the run it belongs to, the checkpoint's own id, a digest of every other file (see
    :func:`~dsa_train.fsutil.file_digest`), the earlier checkpoints it needs (``needs``: those
    its deltas' chains apply to) and a checksum of its own content; a checkpoint whose files do
    not match them (torn, truncated, bit-flipped, edited), that holds a file it does not list,
    or a symbolic link, or whose chain of earlier checkpoints is not intact, is reported and
    passed over for the previous intact one. Nothing in a checkpoint is unpickled: torch files
    are read with ``weights_only=True`` (tensors and plain containers only), the rest is JSON.

    Old checkpoints are pruned to the newest ``keep``, except those a kept checkpoint still
    needs (:meth:`retained`, the one rule, which ``dsa-train clean`` applies too); they are
    renamed to ``.deleting-<step>`` before they are removed, so a kill mid-removal never leaves
    a "complete" checkpoint with files missing. A full disk during a save removes the partial
    folder and raises a ``StateError``; earlier checkpoints stay.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @classmethod
    def of_run(cls, run: Path) -> CheckpointStore:
        """The store of the run folder ``run``."""
        return cls(Path(run) / CHECKPOINTS)

    # -- the layout -------------------------------------------------------------------------
    def get_checkpoint_dir(self, step: int) -> Path:
        return self.folder / step_name(step)

    def get_partial_dir(self, step: int) -> Path:
        return self.folder / f"{PARTIAL}{step_name(step)}"

    @staticmethod
    def get_doomed_dir(checkpoint: Path) -> Path:
        return checkpoint.with_name(DOOMED + checkpoint.name)

    @staticmethod
    def get_trainer_file(checkpoint: Path) -> Path:
        return Path(checkpoint) / TRAINER

    @staticmethod
    def get_model_file(checkpoint: Path) -> Path:
        return Path(checkpoint) / MODEL

    @staticmethod
    def get_tables_dir(checkpoint: Path) -> Path:
        return Path(checkpoint) / TABLES

    # -- which there are, and which stay ----------------------------------------------------
    def complete(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        if self.folder.is_symlink():
            return []
        return [p for p in real_directories(self.folder) if is_step_name(p.name) and is_regular_file(p / TRAINER)]

    def scratch(self) -> list[Path]:
        """Checkpoint folders a killed save or prune left behind (never complete checkpoints)."""
        if self.folder.is_symlink():
            return []
        return [p for p in real_directories(self.folder) if self.is_scratch_name(p.name)]

    @staticmethod
    def is_scratch_name(name: str) -> bool:
        """Whether ``name`` is a checkpoint folder's being written or being removed."""
        return name.startswith((PARTIAL, DOOMED))

    def newest_step(self) -> int | None:
        """The step of the newest complete checkpoint (``None``: there is none)."""
        complete = self.complete()
        return int(complete[-1].name) if complete else None

    @staticmethod
    def needs(checkpoint: Path) -> list[str]:
        """The earlier checkpoints (folder names) whose files this one's deltas are applied to:
        its ``trainer.json``'s ``needs``, read without following a link (``[]`` when it has none,
        or none that is readable). Pruning and ``clean`` never remove a checkpoint a kept one needs."""
        state = read_json_object(Path(checkpoint) / TRAINER)
        needs = state.get("needs") if state and state.get("format") == FORMAT else None
        return [n for n in needs if isinstance(n, str) and is_step_name(n)] if isinstance(needs, list) else []

    @staticmethod
    def best_checkpoint(checkpoint: Path) -> Path | None:
        """The checkpoint of the best evaluation so far that ``checkpoint``'s ``trainer.json``
        names (``best_checkpoint``, with ``eval.select_best``), read without following a link;
        ``None`` when it names none."""
        state = read_json_object(Path(checkpoint) / TRAINER)
        step = state.get("best_checkpoint") if state and state.get("format") == FORMAT else None
        return Path(checkpoint).parent / step_name(step) if isinstance(step, int) and step >= 0 else None

    def retained(
        self, keep: int, *, complete: list[Path] | None = None, held: dict[Path, str] | None = None
    ) -> dict[Path, str]:
        """Which of the ``complete`` checkpoints (oldest first; default: the store's) stay, each
        with why: those ``held`` (with their reasons), the newest ``keep``, and every checkpoint
        a kept one is made of (its ``needs``, which list a delta chain whole), and the best
        evaluation's checkpoint that the newest names (:meth:`best_checkpoint`). The one rule
        for pruning after a save and for ``dsa-train clean``."""
        complete = self.complete() if complete is None else complete
        why = dict(held or {})
        best = self.best_checkpoint(complete[-1]) if complete else None
        if best is not None and best in complete:
            why.setdefault(best, "the best evaluation's checkpoint (eval.select_best)")
        for checkpoint in complete[-keep:] if keep else []:
            why.setdefault(checkpoint, f"one of the newest {keep} checkpoints")
        for kept in list(why):
            for name in self.needs(kept):
                why.setdefault(
                    kept.parent / name, f"checkpoint {kept.name} is made of its deltas on this one: kept with it"
                )
        return why

    def prune(self, keep: int) -> None:
        """Remove the complete checkpoints :meth:`retained` does not keep, each renamed to its
        doomed name first (no longer complete the moment its removal starts)."""
        complete = self.complete()
        kept = self.retained(keep, complete=complete)
        for old in complete:
            if old not in kept:
                doomed = self.get_doomed_dir(old)
                os.rename(old, doomed)
                shutil.rmtree(doomed)

    # -- saving -------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer: dict,
        *,
        keep: int,
        extra: dict[str, object] | None = None,
    ) -> Path:
        """Commit a checkpoint of ``step``, then prune to ``keep``; ``extra`` maps file names to
        more objects to ``torch.save``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.scratch():  # left by a process killed mid-save or mid-prune
            shutil.rmtree(stale)
        final = self.get_checkpoint_dir(step)
        partial = self.get_partial_dir(step)
        checkpoint_id = uuid.uuid4().hex
        rows = _rows()
        try:
            writer = rows.RowWriter(
                partial, optimizer, rows.baseline(self, optimizer, final.name), rows.clones(self.folder)
            )
            rows.write_checkpoint(
                partial, model, optimizer, {**trainer, "checkpoint_id": checkpoint_id}, extra or {}, writer
            )
        except OSError as e:
            shutil.rmtree(partial, ignore_errors=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StateError(
                    f"the disk is full: checkpoint of step {step} could not be written in '{self.folder}'",
                    hint="free some space and run again with --resume; the previous checkpoints are intact",
                ) from None
            raise
        if final.exists():  # the same step saved again (a resumed run reaching it): replace it
            shutil.rmtree(final)
        os.rename(partial, final)
        fsync_directory(self.folder)
        rows.count_from(optimizer, f"{final.name}:{checkpoint_id}")  # the next deltas apply to this one
        self.prune(keep)  # the newest, and the bases and links of their chains
        return final

    @staticmethod
    def count_from_creation(optimizer: torch.optim.Optimizer) -> None:
        """Say that the optimizer's files are exactly as they were made (a fresh run: its disk
        tables just written by ``Table.create``, its row files just created, nothing stepped):
        its dirty rows then cover every change, and the next checkpoint writes deltas on the
        virtual bases instead of full copies."""
        rows = _rows()
        rows.count_from(optimizer, rows.FRESH)

    @staticmethod
    def count_from_checkpoint(optimizer: torch.optim.Optimizer, checkpoint: Path, state: dict) -> None:
        """Say that the optimizer's files are the checkpoint's (a resume restored them; ``state``
        its trainer state): the next checkpoint writes deltas on this one."""
        checkpoint_id = state.get("checkpoint_id")
        _rows().count_from(optimizer, f"{checkpoint.name}:{checkpoint_id}" if isinstance(checkpoint_id, str) else None)

    def mode(self, optimizer: torch.optim.Optimizer) -> str:
        """How this run's checkpoints write row files, in words (for the run's notes)."""
        return _rows().checkpoint_mode(self.folder, optimizer)

    # -- reading and checking -------------------------------------------------------------------
    @staticmethod
    def read_state(checkpoint: Path) -> dict:
        """A checkpoint's ``trainer.json``, its format, version and checksum checked."""
        try:
            state = json.loads((checkpoint / TRAINER).read_bytes())
        except (OSError, ValueError) as e:
            raise StateError(
                f"checkpoint '{checkpoint}' is unreadable: {e}", hint="resume from an older checkpoint"
            ) from None
        if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("version") not in READABLE:
            found = (state.get("format"), state.get("version")) if isinstance(state, dict) else (None, None)
            raise StateError(
                f"checkpoint '{checkpoint}' has format {found[0]!r} version {found[1]!r}, "
                f"this dsa-train reads {FORMAT!r} versions {', '.join(map(str, READABLE))}",
                hint="resume it with the dsa-train version that wrote it",
            )
        if state.get("checksum") != trainer_checksum(state):
            raise StateError(
                f"checkpoint '{checkpoint}' is damaged: {TRAINER} does not match its checksum (edited or corrupted)",
                hint="resume from an older checkpoint",
            )
        return state

    def verify(self, checkpoint: Path, _verified: dict[Path, dict] | None = None) -> dict:
        """The trainer state of an intact checkpoint; a ``StateError`` names what is damaged.

        A checkpoint with deltas is intact when every link of their chains is: each delta's
        parent checkpoint is verified in turn (once, however many deltas name it), must carry
        the id the delta names and hold its version of the file with the digest the delta
        names, and the checkpoints so reached must be exactly the ones ``needs`` lists."""
        verified = {} if _verified is None else _verified
        if checkpoint in verified:
            return verified[checkpoint]
        state = self.read_state(checkpoint)
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
        reached: set[str] = set()
        for name in sorted(n for n in files if n.endswith(DELTA_SUFFIX)):
            reached |= self._verify_link(checkpoint, name, verified)
        if reached != set(state.get("needs", [])):
            raise StateError(
                f"checkpoint '{checkpoint}' is damaged: it lists {sorted(state.get('needs', []))} as the checkpoints it "
                f"needs, its deltas need {sorted(reached)}",
                hint="resume from an older checkpoint",
            )
        verified[checkpoint] = state
        return state

    def _verify_link(self, checkpoint: Path, name: str, verified: dict[Path, dict]) -> set[str]:
        """Check the parent of the delta ``name`` and, through it, the rest of its chain; the
        names of the checkpoints the chain passes through."""
        meta = read_delta_header(checkpoint / name)
        link = meta["parent"]
        rel = name.removesuffix(DELTA_SUFFIX)
        if is_virtual(link):  # the file as it was made: nothing to reach, its header must say how
            if meta["file"] != rel:
                raise StateError(
                    f"checkpoint '{checkpoint}' is damaged: {name} names the file {meta['file']!r}",
                    hint="resume from an older checkpoint",
                )
            try:
                chain_of(checkpoint / name)
            except StateError as e:
                raise StateError(
                    f"checkpoint '{checkpoint}' is damaged: {e.message}", hint="resume from an older checkpoint"
                ) from None
            return set()
        parent = checkpoint.parent / link["snapshot"]
        if meta["file"] != rel or not link["snapshot"] < checkpoint.name or not (parent / TRAINER).is_file():
            raise StateError(
                f"checkpoint '{checkpoint}' is damaged: {name} needs checkpoint {link['snapshot']}, which is missing or not older",
                hint="resume from an older checkpoint",
            )
        try:
            state = self.verify(parent, verified)
        except StateError as e:
            raise StateError(
                f"checkpoint '{checkpoint}' is damaged: {name} applies to checkpoint '{parent}', which is damaged ({e.message})",
                hint="resume from an older checkpoint",
            ) from None
        held = rel + DELTA_SUFFIX if link["delta"] else rel
        if state.get("checkpoint_id") != link.get("id") or state["files"].get(held) != link.get("digest"):
            raise StateError(
                f"checkpoint '{checkpoint}' is damaged: {name} applies to another version of checkpoint '{parent}' "
                "(its id or its digest of the file differ: it was replaced)",
                hint="resume from an older checkpoint",
            )
        return {link["snapshot"], *state.get("needs", [])} if link["delta"] else {link["snapshot"]}

    def find(self, step: int | None = None) -> tuple[Path, dict, list[str]]:
        """The checkpoint of ``step`` (else the newest intact one), its trainer state, and a warning
        for each newer checkpoint passed over as damaged."""
        found = self.complete()
        if not found:
            raise StateError(
                f"'{self.folder}' holds no complete checkpoint",
                hint="train with train.checkpoint_every > 0, or let a run finish (it checkpoints at the end)",
            )
        if step is not None:
            for path in found:
                if int(path.name) == step:
                    return path, self.verify(path), []
            raise StateError(
                f"no checkpoint of step {step} in '{self.folder}'",
                hint=f"available steps: {', '.join(str(int(p.name)) for p in found)}",
            )
        warnings, verified = [], {}
        for path in reversed(found):
            try:
                return path, self.verify(path, verified), warnings
            except StateError as e:
                warnings.append(f"{e.message}; using an older checkpoint")
        raise StateError(
            f"every checkpoint in '{self.folder}' is damaged:\n  " + "\n  ".join(warnings),
            hint="start the run again without --resume",
        )

    # -- restoring ------------------------------------------------------------------------------
    @staticmethod
    def restore_tables(checkpoint: Path | None, tables: Path) -> None:
        """Make the run's disk tables the checkpoint's versions again (base and deltas, written
        under a temporary name and renamed into place), or remove them, without a checkpoint.

        Only regular files that carry a table header are removed or replaced (and our own
        ``.restore-*`` leftovers); anything else in the folder is a stranger and stops the
        restore before anything changes.
        """
        stale = []
        for entry in os.scandir(tables) if tables.is_dir() else ():
            path = Path(entry.path)
            if entry.name.startswith(RESTORING) and entry.is_file(follow_symlinks=False):
                stale.append(path)
            elif entry.name.endswith(".table") and entry.is_file(follow_symlinks=False) and is_table_file(path):
                stale.append(path)
            elif not entry.name.startswith("."):
                raise StateError(
                    f"'{path}' in the run's table folder is not a dsa-train table; nothing was changed",
                    hint="move it out of the run folder and resume again",
                )
        names = CheckpointStore.table_names(checkpoint) if checkpoint is not None else []
        if names:
            tables.mkdir(parents=True, exist_ok=True)
        for path in stale:
            if path.name not in names:
                path.unlink()
        for name in names:
            restore_row_file(CheckpointStore.get_tables_dir(checkpoint) / name, tables / name)
        if tables.is_dir():
            fsync_directory(tables)

    @staticmethod
    def table_names(checkpoint: Path) -> list[str]:
        """The tables a checkpoint holds (as a base or a delta)."""
        folder = CheckpointStore.get_tables_dir(checkpoint)
        if not folder.is_dir():
            return []
        return sorted(
            {
                p.name.removesuffix(DELTA_SUFFIX)
                for p in folder.iterdir()
                if p.name.removesuffix(DELTA_SUFFIX).endswith(".table")
            }
        )

    @staticmethod
    def table_versions(checkpoint: Path) -> dict[str, Callable[[], ChainEmbedding]]:
        """How to open each table a checkpoint keeps as a delta, to evaluate with, with no table
        written: by file name, a function making a :class:`~dsa_train.nn.ChainEmbedding` that reads
        the checkpoint's version through its chain (the base, a file or the initial table drawn
        again chunk by chunk, with the deltas laid over it). Tables kept whole are not listed:
        they are mapped read-only from the checkpoint's ``tables/``."""
        versions = {}
        folder = CheckpointStore.get_tables_dir(checkpoint)
        for name in CheckpointStore.table_names(checkpoint):
            if not (folder / name).is_file():
                versions[name] = partial(_rows().chain_embedding, chain_of(folder / f"{name}{DELTA_SUFFIX}"))
        return versions

    @staticmethod
    def load_model(checkpoint: Path, model: torch.nn.Module) -> None:
        """Load a checkpoint's model weights into ``model`` (tensors only: nothing runs)."""
        _rows().load_model(CheckpointStore.get_model_file(checkpoint), model)


def _rows():
    """:mod:`.checkpoint_rows`, imported (with torch) on first use."""
    from . import checkpoint_rows

    return checkpoint_rows


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


def restore_row_file(version: Path, target: Path) -> None:
    """Replace ``target`` by the version of a row file a checkpoint holds at ``version`` (a
    base, or ``version + ".delta"``: its chain, materialised), atomically."""
    source = version if version.is_file() else version.with_name(version.name + DELTA_SUFFIX)
    scratch = target.with_name(f"{RESTORING}{uuid.uuid4().hex[:12]}-{target.name}")
    try:
        materialise(chain_of(source), scratch)
        os.replace(scratch, target)
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise


def is_table_file(path: Path) -> bool:
    try:
        return read_row_header(path).get("layout") == TABLE_LAYOUT
    except StateError:
        return False
