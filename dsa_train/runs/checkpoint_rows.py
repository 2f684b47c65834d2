"""How a checkpoint's files are written: the model, the optimizer, and row files as bases or deltas.

Row files (disk tables in ``tables/``, DiskSparseAdam's ``optimizer_state/<key>.rows``) are
written either whole (a *base*: a sparse copy, or a reflink clone where the file system has
them) or as a *delta* (``<file>.delta``, see :mod:`dsa_train.storage.deltas`): only the records
the optimizer wrote since the checkpoint it last saved or resumed from, which the delta names
(folder, id and the digest of its version of the file), or, in a fresh run (see
:meth:`~.checkpoint_store.CheckpointStore.count_from_creation`), since the files were made: a
delta on a *virtual* base, the table as ``Table.create`` drew it (``"initial"``) or the
all-zero row file (``"zeros"``), which no file holds and no checkpoint is needed for. A chain
is compacted when it grows: past :data:`MAX_LINKS` deltas, or past :data:`MAX_DELTA_FRACTION`
of the file's records, the union of the chain's rows is written as one delta on the base;
when even that union passes the fraction (or with reflink clones, which cost no write), a new
base is written. The format is described in docs/checkpoints.md. The
:class:`~.checkpoint_store.CheckpointStore` decides where and when; this module writes.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..errors import StateError
from ..fsutil import copy_sparse, file_digest, fsync_all
from ..nn import ChainEmbedding, DiskTable
from ..optim import DiskSparseAdam
from ..storage.deltas import (
    DELTA_SUFFIX,
    VIRTUAL,
    ChainReader,
    LiveRows,
    chain_of,
    read_delta_header,
    snapshot_path,
    write_delta,
)
from ..storage.format import HEADER_BYTES, TABLE_LAYOUT, read_row_header
from ..storage.row_file import RowFile
from ..storage.format import manifest_checksum as trainer_checksum  # one canonical-JSON checksum for both
from . import changed_rows
from .checkpoint_layout import CHECKPOINT_FORMAT, MODEL, PARTIAL, TABLES, TRAINER, VERSION
from .optimizer_state import load_tensors, snapshot_optimizer

MAX_LINKS = 8  # deltas in a chain before it is compacted
MAX_DELTA_FRACTION = 0.5  # of a file's record bytes that a chain's deltas may hold
FICLONE = 0x40049409  # Linux ioctl: make a file share another's blocks (copy-on-write)
FRESH = "initial"  # the optimizer's dirty-rows label in a run whose files are as they were made
_CLONES: dict[str, bool] = {}  # checkpoints folder -> whether its file system clones


def count_from(optimizer: torch.optim.Optimizer, label: str | None) -> None:
    """Count the rows the optimizer writes from ``label`` (a checkpoint's ``<folder>:<id>``, or
    :data:`FRESH`; ``None``: from no known version, so the next checkpoint writes bases) on: a
    :class:`~.changed_rows.ChangedRows` attached to a DiskSparseAdam (other optimizers announce
    no rows: their checkpoints are full copies)."""
    if isinstance(optimizer, DiskSparseAdam):
        changed_rows.count_from(optimizer, label)


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
class Version:
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


class Baseline(Protocol):
    """What the dirty rows are counted from: each file's version there, and its chain's base."""

    def version_of(self, rel: str, source: Path) -> Version | None: ...
    def base_of(self, rel: str, version: Version) -> Version: ...


class Fresh:
    """A fresh run's baseline: every file as it was made, a virtual base (``"initial"`` for a
    disk table whose header records its creation, ``"zeros"`` for any other row file)."""

    def version_of(self, rel: str, source: Path) -> Version | None:
        meta = read_row_header(source)
        if meta.get("layout") == TABLE_LAYOUT:
            if not isinstance(meta.get("creation"), dict):
                return None  # made before tables recorded how: its first checkpoint is a copy
            kind = "initial"
        else:
            kind = "zeros"
        return Version({"virtual": kind}, kind, 0, 0, os.stat(source).st_size, set(), None)

    def base_of(self, rel: str, version: Version) -> Version:
        return version


class RowWriter:
    """Writes each row file into the partial checkpoint as a base or a delta (see the module
    docstring for the rules), and collects the checkpoints the new one needs."""

    def __init__(self, partial: Path, optimizer, baseline: Baseline | None, clones: bool) -> None:
        self.partial, self.optimizer, self.baseline, self.clones = partial, optimizer, baseline, clones
        self.needs: set[str] = set()
        self.synced: set[str] = set()  # files written here, fsynced already
        self.digests: dict[str, str] = {}  # ... and those whose digest was computed as they were written
        self._changed = changed_rows.changed_rows(optimizer) if isinstance(optimizer, DiskSparseAdam) else None
        paths = optimizer.row_files() if isinstance(optimizer, DiskSparseAdam) else {}
        self._live = {path.resolve(): optimizer.live_row_file(path) for path in paths}

    def owned(self, source: Path) -> bool:
        """Whether the optimizer writes the row file ``source`` (whose rows it then holds)."""
        return Path(source).resolve() in self._live

    def dirty_rows(self, source: Path) -> np.ndarray | None:
        """The rows of ``source`` the optimizer wrote since the baseline (``None``: none counted)."""
        return self._changed.rows(source) if self._changed is not None else None

    def __call__(self, source: Path, rel: str, live: np.ndarray | None = None) -> None:
        """Write ``source`` as ``rel`` in the checkpoint; ``live``: its records as the process
        maps them already (see :class:`~dsa_train.storage.deltas.LiveRows`), to gather from. A
        row file the optimizer writes is copied as the optimizer holds it, never flushed
        first (but for a clone, which shares the file's blocks): its changed rows are written
        once, into the checkpoint."""
        target = self.partial / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        live_file = self._live.get(Path(source).resolve())
        if live_file is not None:
            live = live_file.record_bytes
        rows = self.dirty_rows(source) if self.baseline is not None else None
        parent = self.baseline.version_of(rel, source) if rows is not None else None
        size = os.stat(source).st_size
        if parent is None or parent.file_bytes != size:
            return self._base(source, target, live_file)
        row_bytes = read_row_header(source)["row_bytes"]
        limit = MAX_DELTA_FRACTION * (size - HEADER_BYTES)
        if parent.links + 1 <= MAX_LINKS and parent.chain_bytes + len(rows) * row_bytes <= limit:
            source = LiveRows(source, live) if live is not None else source
            return self._delta(
                source,
                rows,
                target,
                rel,
                row_bytes,
                parent,
                parent.links + 1,
                parent.chain_bytes + len(rows) * row_bytes,
            )
        if self.clones or parent.links == 0:
            return self._base(source, target, live_file)
        chain = chain_of(parent.path)  # compaction: the union of the chain's rows, on its base
        union = np.union1d(rows, np.concatenate([_delta_rows(path) for path in chain[1:]]))
        if len(union) * row_bytes > limit:
            return self._base(source, target, live_file)
        source = LiveRows(source, live) if live is not None else source
        return self._delta(
            source, union, target, rel, row_bytes, self.baseline.base_of(rel, parent), 1, len(union) * row_bytes
        )

    def _base(self, source: Path, target: Path, live_file: RowFile | None) -> None:
        if self.clones:
            if live_file is not None:
                live_file.flush()  # a clone shares the file's blocks: they must hold every row first
            if _clone(source, target):
                return self.synced.add(str(target.relative_to(self.partial)))
        if live_file is not None:
            live_file.copy_to(target)
        else:
            copy_sparse(source, target)
        self.synced.add(str(target.relative_to(self.partial)))  # both fsync; its digest reads it (a clone too)

    def _delta(self, source, rows, target, rel, row_bytes, parent: Version, links: int, chain_bytes: int) -> None:
        meta = {
            "file": rel,
            "row_bytes": row_bytes,
            "parent": parent.link,
            "base": parent.base,
            "links": links,
            "chain_bytes": chain_bytes,
        }
        written = write_delta(
            source, rows, target.with_name(target.name + DELTA_SUFFIX), meta
        )  # fsynced, digested as written
        self.synced.add(rel + DELTA_SUFFIX)
        self.digests[rel + DELTA_SUFFIX] = written.digest
        self.needs |= parent.needs


def live_records(module: DiskTable) -> np.ndarray | None:
    """A disk table's records as the run maps them (:attr:`RowFile.record_bytes`), or ``None``."""
    rows = getattr(module.table, "rows", None)
    return rows.record_bytes if isinstance(rows, RowFile) else None


def _delta_rows(path: Path) -> np.ndarray:
    meta = read_delta_header(path)
    with open(path, "rb") as f:
        f.seek(2 * HEADER_BYTES)
        return np.frombuffer(f.read(8 * meta["rows"]), dtype="<i8")


def load_model(path: Path, model: torch.nn.Module) -> None:
    """Load the weights of a checkpoint's ``model.pt`` at ``path`` into ``model`` (tensors only)."""
    model.load_state_dict(load_tensors(path))


def chain_embedding(chain: list[Path]) -> ChainEmbedding:
    return ChainEmbedding(ChainReader(chain, read_delta_header(chain[-1])["row_bytes"]))


class Checkpointed:
    """A checkpoint the optimizer's dirty rows are counted from, and its trainer state: the
    :class:`Baseline` deltas are written on (``store``: the
    :class:`~.checkpoint_store.CheckpointStore` it is in)."""

    def __init__(self, store, folder: Path, state: dict) -> None:
        self.store, self.folder, self.state = store, folder, state

    def version_of(self, rel: str, source: Path) -> Version | None:
        """The baseline's version of the file ``rel``, or ``None`` when it holds none."""
        files, name = self.state["files"], self.folder.name
        is_delta = rel not in files
        digest = files.get(rel + DELTA_SUFFIX if is_delta else rel)
        if digest is None:
            return None
        path = snapshot_path(self.folder.parent, name, rel, delta=is_delta)
        link = {"snapshot": name, "id": self.state["checkpoint_id"], "digest": digest, "delta": is_delta}
        if not is_delta:
            return Version(link, name, 0, 0, os.stat(path).st_size, {name}, path)
        meta = read_delta_header(path)
        needs = {name, *self.store.needs(self.folder)} if meta["base"] != name else {name}
        return Version(link, meta["base"], meta["links"], meta["chain_bytes"], meta["file_bytes"], needs, path)

    def base_of(self, rel: str, version: Version) -> Version:
        """The base of ``version``'s chain, as a version to write a compacted delta on."""
        if version.base in VIRTUAL:
            return Version({"virtual": version.base}, version.base, 0, 0, version.file_bytes, set(), None)
        state = self.store.read_state(self.folder.parent / version.base)
        link = {"snapshot": version.base, "id": state["checkpoint_id"], "digest": state["files"][rel], "delta": False}
        return Version(link, version.base, 0, 0, version.file_bytes, {version.base}, None)


def baseline(store, optimizer: torch.optim.Optimizer, name: str) -> Baseline | None:
    """What the optimizer's dirty rows are counted from in ``store`` (the run's
    :class:`~.checkpoint_store.CheckpointStore`): the files as made (a fresh run), or a
    checkpoint, if it is still there as it was (its id matches) and is not the one about to be
    replaced; else ``None`` (write bases)."""
    changed = changed_rows.changed_rows(optimizer) if isinstance(optimizer, DiskSparseAdam) else None
    label = changed.since if changed is not None else None
    if label is None:
        return None
    if label == FRESH:
        return Fresh()
    folder_name, _, checkpoint_id = label.partition(":")
    folder = store.folder / folder_name
    if folder_name == name or not (folder / TRAINER).is_file():
        return None
    try:
        state = store.read_state(folder)
    except StateError:
        return None
    return Checkpointed(store, folder, state) if state.get("checkpoint_id") == checkpoint_id else None


def write_checkpoint(
    partial: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer: dict, extra: dict, rows: RowWriter
) -> None:
    """Every file of a checkpoint into its ``partial`` folder, each fsynced once and digested
    once (a delta as it is written), then ``trainer.json``, then the folders. The optimizer's
    row files are copied as it holds them, not flushed: the live files stay as they were."""
    manifest = (
        optimizer.snapshot_manifest() if isinstance(optimizer, DiskSparseAdam) else None
    )  # first: a broken step refuses here
    partial.mkdir()
    torch.save(model.state_dict(), partial / MODEL)  # a disk table's entry is a reference...
    for module in model.modules():  # ...and its file (weights and moments) is a base or a delta
        if isinstance(module, DiskTable):
            if not rows.owned(module.path):
                module.flush()  # a table no DiskSparseAdam writes: its file is what is copied
            rows(module.path, f"{TABLES}/{module.path.name}", live_records(module))
    snapshot_optimizer(optimizer, partial, rows, manifest)
    for name, obj in extra.items():
        torch.save(obj, partial / name)
    files = {str(p.relative_to(partial)): p for p in sorted(partial.rglob("*")) if p.is_file()}
    digests = {
        name: rows.digests.get(name) or file_digest(path) for name, path in files.items()
    }  # small files: page cache
    state = {"format": CHECKPOINT_FORMAT, "version": VERSION, **trainer, "needs": sorted(rows.needs), "files": digests}
    fd = os.open(partial / TRAINER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({**state, "checksum": trainer_checksum(state)}, indent=2))
    unsynced = [path for name, path in files.items() if name not in rows.synced]
    fsync_all([*unsynced, partial / TRAINER, *(p for p in partial.rglob("*") if p.is_dir()), partial])
