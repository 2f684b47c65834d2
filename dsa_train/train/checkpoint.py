"""Checkpoints that are complete or absent, never half-written, and checked when read.

A checkpoint is built in ``checkpoints/.partial-<step>/`` (model weights, the disk tables,
the optimizer state, ``trainer.json``), every file fsynced, then renamed to
``checkpoints/<step>/`` and the parent fsynced: the rename is the commit. ``trainer.json``
carries the format version, the id of the run it belongs to, the checkpoint's own id, a
digest of every other file (see :func:`~dsa_train.fsutil.file_digest`), the earlier
checkpoints it needs (``needs``) and a checksum of its own content; a checkpoint whose files
do not match them (torn, truncated, bit-flipped, edited), that holds a file it does not list,
or a symbolic link, or whose chain of earlier checkpoints is not intact, is reported and
passed over for the previous intact one. Nothing in a checkpoint is unpickled: torch files
are read with ``weights_only=True`` (tensors and plain containers only), the rest is JSON.

Row files (disk tables in ``tables/``, DiskSparseAdam's ``optimizer_state/<key>.rows``) are
written either whole (a *base*: a sparse copy, or a reflink clone where the file system has
them) or as a *delta* (``<file>.delta``, see :mod:`dsa_train.optim.deltas`): only the records
the optimizer wrote since the checkpoint it last saved or resumed from, which the delta names
(folder, id and the digest of its version of the file), or, in a fresh run (see
:func:`count_from_creation`), since the files were made: a delta on a *virtual* base, the
table as ``Table.create`` drew it (``"initial"``) or the all-zero row file (``"zeros"``), which
no file holds and no checkpoint is needed for. A chain is compacted when it grows:
past :data:`MAX_LINKS` deltas, or past :data:`MAX_DELTA_FRACTION` of the file's records, the
union of the chain's rows is written as one delta on the base; when even that union passes
the fraction (or with reflink clones, which cost no write), a new base is written. The format
is described in docs/checkpoints.md. Old checkpoints are pruned to the newest ``keep``, except
those a kept checkpoint still needs; they are renamed to ``.deleting-<step>`` before they are
removed, so a kill mid-removal never leaves a "complete" checkpoint with files missing. A full
disk during a save removes the partial folder and raises a ``StateError``; earlier
checkpoints stay.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..errors import StateError
from ..fsutil import copy_sparse, file_digest, fsync_all, fsync_directory
from ..nn import ChainEmbedding, DiskTable
from ..optim import DiskSparseAdam
from ..optim.deltas import (
    DELTA_SUFFIX,
    VIRTUAL,
    ChainReader,
    LiveRows,
    chain_of,
    is_virtual,
    materialise,
    read_delta_header,
    snapshot_path,
    write_delta,
)
from ..optim.format import HEADER_BYTES, TABLE_LAYOUT, read_row_header
from ..optim.format import manifest_checksum as trainer_checksum  # one canonical-JSON checksum for both
from .optimizers import load_tensors, snapshot_optimizer
from .checkpoint_layout import CHECKPOINT_FORMAT as FORMAT
from .checkpoint_layout import (
    DOOMED,
    MODEL,
    PARTIAL,
    RESTORING,
    TABLES,
    TRAINER,
    checkpoint_needs,
    complete_checkpoints,
    retained,
    scratch_folders,
    step_name,
)

VERSION = 4  # 4: deltas on virtual bases; 3: row files as bases or deltas, ids and needs; 2: every file whole
READABLE = (2, 3, 4)  # a version 2 checkpoint is version 3 without deltas, 3 is 4 without virtual bases
MAX_LINKS = 8  # deltas in a chain before it is compacted
MAX_DELTA_FRACTION = 0.5  # of a file's record bytes that a chain's deltas may hold
FICLONE = 0x40049409  # Linux ioctl: make a file share another's blocks (copy-on-write)
FRESH = "initial"  # the optimizer's dirty-rows label in a run whose files are as they were made
_CLONES: dict[str, bool] = {}  # checkpoints folder -> whether its file system clones


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
    final = checkpoints / step_name(step)
    partial = checkpoints / f"{PARTIAL}{step_name(step)}"
    checkpoint_id = uuid.uuid4().hex
    try:
        rows = _RowWriter(partial, optimizer, _baseline(checkpoints, optimizer, final.name), clones(checkpoints))
        _write(partial, model, optimizer, {**trainer, "checkpoint_id": checkpoint_id}, extra or {}, rows)
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
    if isinstance(optimizer, DiskSparseAdam):
        optimizer.reset_dirty(f"{final.name}:{checkpoint_id}")  # the next deltas apply to this one
    complete = complete_checkpoints(checkpoints)
    kept = retained(complete, keep)  # the newest, and the bases and links of their chains
    for old in complete:
        if old in kept:
            continue
        doomed = old.with_name(DOOMED + old.name)
        os.rename(old, doomed)  # no longer complete the moment removal starts
        shutil.rmtree(doomed)
    return final


def count_from_creation(optimizer: torch.optim.Optimizer) -> None:
    """Say that the optimizer's files are exactly as they were made (a fresh run: its disk
    tables just written by ``Table.create``, its row files just created, nothing stepped):
    its dirty rows then cover every change, and the next checkpoint writes deltas on the
    virtual bases instead of full copies."""
    if isinstance(optimizer, DiskSparseAdam):
        optimizer.reset_dirty(FRESH)


def checkpoint_mode(checkpoints: Path, optimizer: torch.optim.Optimizer) -> str:
    """How this run's checkpoints write row files, in words (for the run's notes)."""
    if not isinstance(optimizer, DiskSparseAdam):
        return "full copies (this optimizer does not record the rows it writes)"
    if clones(checkpoints):
        return "deltas of changed rows, bases as reflink clones"
    return "deltas of changed rows, bases as full copies (no reflink clones on this file system)"


def clones(checkpoints: Path) -> bool:
    """Whether ``checkpoints`` (or, before it exists, its parent) can clone files: tried once
    per folder with ``FICLONE`` on two scratch files."""
    folder = checkpoints if checkpoints.is_dir() else checkpoints.parent
    key = str(folder.resolve())
    if key not in _CLONES:
        probe = folder / f"{PARTIAL}probe-{uuid.uuid4().hex[:12]}"
        try:
            probe.write_bytes(b"\0" * 4096)
            _CLONES[key] = _clone(probe, probe.with_name(probe.name + "-clone"))
        finally:
            for path in (probe, probe.with_name(probe.name + "-clone")):
                path.unlink(missing_ok=True)
    return _CLONES[key]


def _clone(source: Path, target: Path) -> bool:
    """Make ``target`` (new, never through a link) a copy-on-write clone of ``source``;
    ``False`` (and no ``target``) where the file system cannot."""
    with open(source, "rb") as src:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.ioctl(fd, FICLONE, src.fileno())
            os.fsync(fd)
            return True
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            target.unlink()
            return False
        finally:
            os.close(fd)


@dataclass
class _Version:
    """A version of a row file that a new delta can apply to: ``link`` is what the delta names
    as its parent, ``base`` and ``links`` where its chain starts and how long it is,
    ``chain_bytes`` the chain's record bytes, ``needs`` the checkpoints a delta on it needs,
    ``path`` its file (``None`` for a virtual base)."""

    link: dict
    base: str
    links: int
    chain_bytes: int
    file_bytes: int
    needs: set[str]
    path: Path | None


class _Baseline:
    """The checkpoint the optimizer's dirty rows are counted from, and its trainer state."""

    def __init__(self, folder: Path, state: dict) -> None:
        self.folder, self.state = folder, state

    def version_of(self, rel: str, source: Path) -> _Version | None:
        """The baseline's version of the file ``rel``, or ``None`` when it holds none."""
        files, name = self.state["files"], self.folder.name
        is_delta = rel not in files
        digest = files.get(rel + DELTA_SUFFIX if is_delta else rel)
        if digest is None:
            return None
        path = snapshot_path(self.folder.parent, name, rel, delta=is_delta)
        link = {"snapshot": name, "id": self.state["checkpoint_id"], "digest": digest, "delta": is_delta}
        if not is_delta:
            return _Version(link, name, 0, 0, os.stat(path).st_size, {name}, path)
        meta = read_delta_header(path)
        needs = {name, *checkpoint_needs(self.folder)} if meta["base"] != name else {name}
        return _Version(link, meta["base"], meta["links"], meta["chain_bytes"], meta["file_bytes"], needs, path)

    def base_of(self, rel: str, version: _Version) -> _Version:
        """The base of ``version``'s chain, as a version to write a compacted delta on."""
        if version.base in VIRTUAL:
            return _Version({"virtual": version.base}, version.base, 0, 0, version.file_bytes, set(), None)
        state = read_trainer_state(self.folder.parent / version.base)
        link = {"snapshot": version.base, "id": state["checkpoint_id"], "digest": state["files"][rel], "delta": False}
        return _Version(link, version.base, 0, 0, version.file_bytes, {version.base}, None)


class _Fresh:
    """A fresh run's baseline: every file as it was made, a virtual base (``"initial"`` for a
    disk table whose header records its creation, ``"zeros"`` for any other row file)."""

    def version_of(self, rel: str, source: Path) -> _Version | None:
        meta = read_row_header(source)
        if meta.get("layout") == TABLE_LAYOUT:
            if not isinstance(meta.get("creation"), dict):
                return None  # made before tables recorded how: its first checkpoint is a copy
            kind = "initial"
        else:
            kind = "zeros"
        return _Version({"virtual": kind}, kind, 0, 0, os.stat(source).st_size, set(), None)

    def base_of(self, rel: str, version: _Version) -> _Version:
        return version


def _baseline(checkpoints: Path, optimizer: torch.optim.Optimizer, name: str) -> _Baseline | _Fresh | None:
    """What the optimizer's dirty rows are counted from: the files as made (a fresh run), or a
    checkpoint, if it is still there as it was (its id matches) and is not the one about to be
    replaced; else ``None`` (write bases)."""
    label = getattr(optimizer, "dirty_since", None) if isinstance(optimizer, DiskSparseAdam) else None
    if label is None:
        return None
    if label == FRESH:
        return _Fresh()
    folder_name, _, checkpoint_id = label.partition(":")
    folder = checkpoints / folder_name
    if folder_name == name or not (folder / TRAINER).is_file():
        return None
    try:
        state = read_trainer_state(folder)
    except StateError:
        return None
    return _Baseline(folder, state) if state.get("checkpoint_id") == checkpoint_id else None


class _RowWriter:
    """Writes each row file into the partial checkpoint as a base or a delta (see the module
    docstring for the rules), and collects the checkpoints the new one needs."""

    def __init__(self, partial: Path, optimizer, baseline: _Baseline | _Fresh | None, clones: bool) -> None:
        self.partial, self.optimizer, self.baseline, self.clones = partial, optimizer, baseline, clones
        self.needs: set[str] = set()
        self.synced: set[str] = set()  # files written here, fsynced already
        self.digests: dict[str, str] = {}  # ... and those whose digest was computed as they were written
        self._dirty: dict[Path, np.ndarray | None] = {}

    def dirty_rows(self, source: Path) -> np.ndarray | None:
        """The optimizer's dirty rows of ``source`` (``None``: a file it does not write), once."""
        if source not in self._dirty:
            self._dirty[source] = self.optimizer.dirty_rows(source) if isinstance(self.optimizer, DiskSparseAdam) else None
        return self._dirty[source]

    def __call__(self, source: Path, rel: str, live: np.ndarray | None = None) -> None:
        """Write ``source`` as ``rel`` in the checkpoint; ``live``: its records as the process
        maps them already (see :class:`~dsa_train.optim.deltas.LiveRows`), to gather from."""
        target = self.partial / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        rows = self.dirty_rows(source) if self.baseline is not None else None
        parent = self.baseline.version_of(rel, source) if rows is not None else None
        size = os.stat(source).st_size
        if parent is None or parent.file_bytes != size:
            return self._base(source, target)
        row_bytes = read_row_header(source)["row_bytes"]
        limit = MAX_DELTA_FRACTION * (size - HEADER_BYTES)
        if parent.links + 1 <= MAX_LINKS and parent.chain_bytes + len(rows) * row_bytes <= limit:
            source = LiveRows(source, live) if live is not None else source
            return self._delta(source, rows, target, rel, row_bytes, parent, parent.links + 1, parent.chain_bytes + len(rows) * row_bytes)
        if self.clones or parent.links == 0:
            return self._base(source, target)
        chain = chain_of(parent.path)  # compaction: the union of the chain's rows, on its base
        union = np.union1d(rows, np.concatenate([_delta_rows(path) for path in chain[1:]]))
        if len(union) * row_bytes > limit:
            return self._base(source, target)
        source = LiveRows(source, live) if live is not None else source
        return self._delta(source, union, target, rel, row_bytes, self.baseline.base_of(rel, parent), 1, len(union) * row_bytes)

    def _base(self, source: Path, target: Path) -> None:
        if not (self.clones and _clone(source, target)):
            copy_sparse(source, target)
        self.synced.add(str(target.relative_to(self.partial)))  # both fsync; its digest reads it (a clone too)

    def _delta(self, source, rows, target, rel, row_bytes, parent: _Version, links: int, chain_bytes: int) -> None:
        meta = {"file": rel, "row_bytes": row_bytes, "parent": parent.link, "base": parent.base, "links": links, "chain_bytes": chain_bytes}
        written = write_delta(source, rows, target.with_name(target.name + DELTA_SUFFIX), meta)  # fsynced, digested as written
        self.synced.add(rel + DELTA_SUFFIX)
        self.digests[rel + DELTA_SUFFIX] = written.digest
        self.needs |= parent.needs


def _live_records(module: DiskTable) -> np.ndarray | None:
    """A disk table's records as the run maps them, ``(rows, row_bytes)`` uint8, or ``None``."""
    records = getattr(getattr(module.table, "rows", None), "records", None)
    if not isinstance(records, torch.Tensor) or records.device.type != "cpu" or not records.is_contiguous():
        return None
    return records.view(torch.uint8).reshape(records.shape[0], -1).numpy()


def _delta_rows(path: Path) -> np.ndarray:
    meta = read_delta_header(path)
    with open(path, "rb") as f:
        f.seek(2 * HEADER_BYTES)
        return np.frombuffer(f.read(8 * meta["rows"]), dtype="<i8")


def _write(partial: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer: dict, extra: dict, rows: _RowWriter) -> None:
    """Every file of the checkpoint, each fsynced once and digested once (a delta as it is
    written), then ``trainer.json``, then the folders."""
    partial.mkdir()
    flushed = isinstance(optimizer, DiskSparseAdam)
    if flushed:
        optimizer.flush()  # once: its row files, the disk tables it writes, a clean manifest to copy
    torch.save(model.state_dict(), partial / MODEL)  # a disk table's entry is a reference...
    for module in model.modules():  # ...and its file (weights and moments) is a base or a delta
        if isinstance(module, DiskTable):
            if not (flushed and rows.dirty_rows(module.path) is not None):
                module.flush()  # a table no DiskSparseAdam writes (the one that does has just flushed it)
            rows(module.path, f"{TABLES}/{module.path.name}", _live_records(module))
    snapshot_optimizer(optimizer, partial, rows, flushed=flushed)
    for name, obj in extra.items():
        torch.save(obj, partial / name)
    files = {str(p.relative_to(partial)): p for p in sorted(partial.rglob("*")) if p.is_file()}
    digests = {name: rows.digests.get(name) or file_digest(path) for name, path in files.items()}  # small files: page cache
    state = {"format": FORMAT, "version": VERSION, **trainer, "needs": sorted(rows.needs), "files": digests}
    fd = os.open(partial / TRAINER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({**state, "checksum": trainer_checksum(state)}, indent=2))
    unsynced = [path for name, path in files.items() if name not in rows.synced]
    fsync_all([*unsynced, partial / TRAINER, *(p for p in partial.rglob("*") if p.is_dir()), partial])


def read_trainer_state(checkpoint: Path) -> dict:
    try:
        state = json.loads((checkpoint / TRAINER).read_bytes())
    except (OSError, ValueError) as e:
        raise StateError(f"checkpoint '{checkpoint}' is unreadable: {e}", hint="resume from an older checkpoint") from None
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


def verify_checkpoint(checkpoint: Path, _verified: dict[Path, dict] | None = None) -> dict:
    """The trainer state of an intact checkpoint; a ``StateError`` names what is damaged.

    A checkpoint with deltas is intact when every link of their chains is: each delta's
    parent checkpoint is verified in turn (once, however many deltas name it), must carry
    the id the delta names and hold its version of the file with the digest the delta
    names, and the checkpoints so reached must be exactly the ones ``needs`` lists."""
    verified = {} if _verified is None else _verified
    if checkpoint in verified:
        return verified[checkpoint]
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
    reached: set[str] = set()
    for name in sorted(n for n in files if n.endswith(DELTA_SUFFIX)):
        reached |= _verify_link(checkpoint, name, verified)
    if reached != set(state.get("needs", [])):
        raise StateError(
            f"checkpoint '{checkpoint}' is damaged: it lists {sorted(state.get('needs', []))} as the checkpoints it "
            f"needs, its deltas need {sorted(reached)}",
            hint="resume from an older checkpoint",
        )
    verified[checkpoint] = state
    return state


def _verify_link(checkpoint: Path, name: str, verified: dict[Path, dict]) -> set[str]:
    """Check the parent of the delta ``name`` and, through it, the rest of its chain; the
    names of the checkpoints the chain passes through."""
    meta = read_delta_header(checkpoint / name)
    link = meta["parent"]
    rel = name.removesuffix(DELTA_SUFFIX)
    if is_virtual(link):  # the file as it was made: nothing to reach, its header must say how
        if meta["file"] != rel:
            raise StateError(
                f"checkpoint '{checkpoint}' is damaged: {name} names the file {meta['file']!r}", hint="resume from an older checkpoint"
            )
        try:
            chain_of(checkpoint / name)
        except StateError as e:
            raise StateError(f"checkpoint '{checkpoint}' is damaged: {e.message}", hint="resume from an older checkpoint") from None
        return set()
    parent = checkpoint.parent / link["snapshot"]
    if meta["file"] != rel or not link["snapshot"] < checkpoint.name or not (parent / TRAINER).is_file():
        raise StateError(
            f"checkpoint '{checkpoint}' is damaged: {name} needs checkpoint {link['snapshot']}, which is missing or not older",
            hint="resume from an older checkpoint",
        )
    try:
        state = verify_checkpoint(parent, verified)
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
    warnings, verified = [], {}
    for path in reversed(found):
        try:
            return path, verify_checkpoint(path, verified), warnings
        except StateError as e:
            warnings.append(f"{e.message}; using an older checkpoint")
    raise StateError(
        f"every checkpoint in '{checkpoints}' is damaged:\n  " + "\n  ".join(warnings),
        hint="start the run again without --resume",
    )


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
    names = _table_names(checkpoint) if checkpoint is not None else []
    if names:
        tables.mkdir(parents=True, exist_ok=True)
    for path in stale:
        if path.name not in names:
            path.unlink()
    for name in names:
        restore_row_file(checkpoint / TABLES / name, tables / name)
    if tables.is_dir():
        fsync_directory(tables)


def _table_names(checkpoint: Path) -> list[str]:
    """The tables a checkpoint holds (as a base or a delta)."""
    folder = checkpoint / TABLES
    if not folder.is_dir():
        return []
    return sorted({p.name.removesuffix(DELTA_SUFFIX) for p in folder.iterdir() if p.name.removesuffix(DELTA_SUFFIX).endswith(".table")})


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


def table_versions(checkpoint: Path) -> dict[str, Callable[[], ChainEmbedding]]:
    """How to open each table a checkpoint keeps as a delta, to evaluate with, with no table
    written: by file name, a function making a :class:`~dsa_train.nn.ChainEmbedding` that reads
    the checkpoint's version through its chain (:class:`ChainReader`: the base, a file or the
    initial table drawn again chunk by chunk, with the deltas laid over it). Tables kept whole
    are not listed: they are mapped read-only from the checkpoint's ``tables/``."""
    versions = {}
    for name in _table_names(checkpoint):
        if not (checkpoint / TABLES / name).is_file():
            chain = chain_of(checkpoint / TABLES / f"{name}{DELTA_SUFFIX}")
            versions[name] = partial(_chain_embedding, chain)
    return versions


def _chain_embedding(chain: list[Path]) -> ChainEmbedding:
    return ChainEmbedding(ChainReader(chain, read_delta_header(chain[-1])["row_bytes"]))


def is_table_file(path: Path) -> bool:
    try:
        return read_row_header(path).get("layout") == TABLE_LAYOUT
    except StateError:
        return False


def load_model_state(checkpoint: Path, model: torch.nn.Module) -> None:
    model.load_state_dict(load_tensors(checkpoint / MODEL))

