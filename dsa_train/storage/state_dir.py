"""The optimizer state directory: a manifest, one row file per parameter, and a lock.

::

    state_dir/
      manifest.json   format and version, the state's id, whether it was closed cleanly, the
                      hyper-parameters, and per parameter its shape, dtype, layout, step
                      counter and file; replaced atomically, it is the commit point
      <key>.rows      the parameter's moments (see :mod:`.row_file`); a disk table's weight
                      has none here: its moments live in its table (see :mod:`.table`),
                      which the manifest names by path and id
      .lock           held exclusively (``flock``) while an optimizer has the directory open

Opening checks everything before writing anything, so a failed open leaves the files as they
were. A new parameter's row file is written under a temporary name and renamed into place
only after the manifest that lists it has been committed.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from ..errors import StateError
from ..fsutil import DirectoryLock, atomic_write_bytes, fsync_directory, this_process
from .format import (
    LAYOUT,
    MANIFEST,
    TABLE_LAYOUT,
    PENDING_SUFFIX,
    ROWS_SUFFIX,
    STATE_FORMAT,
    STATE_VERSION,
    RowSpec,
    create_row_file,
    load_manifest,
    manifest_bytes,
)
from .row_file import RowFile
from .table import Table


class StateDirectory:
    """An open, locked state directory with one :class:`RowFile` per parameter."""

    def __init__(self, path: Path, *, allow_unclean: bool = False) -> None:
        self.path = Path(path)
        _prepare_directory(self.path)
        self._owner = os.getpid()  # a forked child (a DataLoader worker) must not write here
        self._lock = DirectoryLock(self.path, purpose="optimizer state directory")
        self._lock.acquire()
        try:
            self._manifest = self._read_or_new_manifest(allow_unclean)
        except BaseException:
            self._lock.release()
            raise
        self.files: dict[str, RowFile] = {}
        self._borrowed: set[str] = set()  # keys whose row file is a table's: its owner closes it
        #: Live step counter of each open parameter and the hyper-parameters, kept current by
        #: the optimizer and committed to the manifest by :meth:`flush`.
        self.steps: dict[str, int] = {}
        self.groups: list[dict] = self._manifest["groups"]
        #: Why a step stopped half-way (an exception between or inside parameter updates), or
        #: ``None``. A broken directory is never flushed as clean: it stays marked unclean.
        self.broken: str | None = None

    # -- opening ------------------------------------------------------------------------
    def _read_or_new_manifest(self, allow_unclean: bool) -> dict:
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            _refuse_foreign_files(self.path)
            return {
                "format": STATE_FORMAT,
                "version": STATE_VERSION,
                "state_id": uuid.uuid4().hex,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "clean": True,
                "groups": [],
                "params": {},
            }
        manifest = load_manifest(manifest_path)
        if not manifest["clean"] and not allow_unclean:
            last = manifest.get("last_writer", {})
            raise StateError(
                f"state_dir '{self.path}' was not closed cleanly: the process that last wrote "
                f"it (pid {last.get('pid', '?')}, '{last.get('command', '?')}') stopped without "
                "flush() or close(), so its moments may be ahead of the step counters "
                f"recorded at the last flush ({_steps_text(manifest)})",
                hint="restore the state directory from a checkpoint, or pass "
                "allow_unclean=True to continue with the moments as they are",
            )
        return manifest

    @property
    def state_id(self) -> str:
        return self._manifest["state_id"]

    @property
    def clean(self) -> bool:
        return self._manifest["clean"]

    def known(self) -> Mapping[str, dict]:
        """The parameters the manifest lists, by key."""
        return self._manifest["params"]

    def check(self, key: str, shape: tuple[int, ...], dtype: str, table: Table | None, layout: str) -> None:
        """Raise if ``key`` is listed with another shape, dtype or layout than the parameter's,
        or, for a disk table's weight, with the moments of another table."""
        entry = self._manifest["params"][key]
        for field, ours in (("shape", list(shape)), ("dtype", dtype), ("layout", layout)):
            if entry.get(field) != ours:
                raise StateError(
                    f"parameter '{key}' has {field} {ours}, but state_dir '{self.path}' holds "
                    f"its moments with {field} {entry.get(field)}",
                    hint="use the model the state was made for, or a fresh state_dir",
                )
        if table is None:
            return
        if entry.get("table_id") != table.table_id:
            raise StateError(
                f"parameter '{key}' is the weight of table '{table.path}' (id {table.table_id}), but "
                f"state_dir '{self.path}' holds the moments of table '{entry.get('table')}' "
                f"(id {entry.get('table_id')})",
                hint="open the table the state was trained with, or a fresh state_dir",
            )
        if table.moments_of != self.state_id:
            raise StateError(
                f"table '{table.path}' holds the moments of another optimizer state "
                f"(id {table.moments_of}), not of state_dir '{self.path}' (id {self.state_id})",
                hint="open the state_dir that trained this table, or restore both from one checkpoint",
            )
        entry["table"] = str(table.path.resolve())  # it may have moved with its state: follow it

    def open(self, params: Mapping[str, tuple[tuple[int, ...], str, Table | None, str]]) -> dict[str, int]:
        """Open (or create) the row files of ``params`` (key -> (shape, dtype, table, layout)).

        A parameter that is a disk table's weight (``table`` not ``None``) keeps its moments
        in that table: no row file is made for it, the manifest names the table. Every check
        runs before anything is written. Returns each key's step counter.
        """
        for key, (shape, dtype, table, layout) in params.items():
            if key in self.known():
                self.check(key, shape, dtype, table, layout)
            elif table is not None and table.moments_of is not None:
                raise StateError(
                    f"table '{table.path}' already holds moments trained with the optimizer state "
                    f"id {table.moments_of}; the new state_dir '{self.path}' would continue them "
                    "with its step counter at 0",
                    hint="open the state_dir that trained this table, or start from a new table",
                )
        opened = {}
        try:
            for key, (_, _, table, _) in params.items():
                if key in self.known():
                    opened[key] = table.rows if table is not None else self._open_existing(key)
            new = {k: v for k, v in params.items() if k not in self.known()}
            if new:
                opened.update(self._create(new))
        except BaseException:
            for key, row_file in opened.items():
                if params[key][2] is None:
                    row_file.close()
            raise
        self.files.update(opened)
        self._borrowed.update(key for key, (_, _, table, _) in params.items() if table is not None)
        steps = {key: self._manifest["params"][key]["step"] for key in params}
        self.steps.update(steps)
        return steps

    def _open_existing(self, key: str) -> RowFile:
        entry = self._manifest["params"][key]
        path = self.path / entry["file"]
        pending = path.with_name(path.name.removesuffix(ROWS_SUFFIX) + PENDING_SUFFIX)
        if not path.exists() and pending.exists():
            # The manifest listing this file was committed, the rename was not: finish it.
            os.replace(pending, path)
            fsync_directory(self.path)
        if not path.exists():
            raise StateError(
                f"row file '{path}' of parameter '{key}' is missing",
                hint="restore the state directory from a checkpoint or start a fresh one",
            )
        spec = RowSpec(key, tuple(entry["shape"]), entry["dtype"], self.state_id, entry.get("layout", LAYOUT))
        return RowFile(path, spec)

    def _create(self, params: Mapping[str, tuple[tuple[int, ...], str, Table | None, str]]) -> dict[str, RowFile]:
        specs = {
            key: RowSpec(key, tuple(shape), dtype, self.state_id, layout)
            for key, (shape, dtype, _, layout) in params.items()
        }
        tables = {key: table for key, (_, _, table, _) in params.items() if table is not None}
        own = [key for key in specs if key not in tables]
        for key in own:
            create_row_file(self.path / (key + PENDING_SUFFIX), specs[key])
        for key, spec in specs.items():
            entry = {
                "shape": list(spec.shape),
                "dtype": spec.dtype,
                "layout": spec.layout,
                "row_bytes": spec.row_bytes,
                "step": 0,
                "file": key + ROWS_SUFFIX,
            }
            if key in tables:
                table = tables[key]
                entry.update(
                    layout=TABLE_LAYOUT,
                    row_bytes=table.spec.row_bytes,
                    file=table.path.name,
                    table=str(table.path.resolve()),
                    table_id=table.table_id,
                )
            self._manifest["params"][key] = entry
        # The table names this state before the manifest names the table: a crash in between
        # leaves a table that a fresh state refuses, never moments continued by a stranger.
        for table in tables.values():
            table.adopt(self.state_id)
        self._write_manifest()
        for key in own:
            os.replace(self.path / (key + PENDING_SUFFIX), self.path / (key + ROWS_SUFFIX))
        fsync_directory(self.path)
        opened = {key: RowFile(self.path / (key + ROWS_SUFFIX), specs[key]) for key in own}
        return {**opened, **{key: table.rows for key, table in tables.items()}}

    # -- writing ------------------------------------------------------------------------
    def _write_manifest(self) -> None:
        self._manifest["last_writer"] = this_process()
        self._manifest.pop("checksum", None)
        atomic_write_bytes(self.path / MANIFEST, manifest_bytes(self._manifest))

    def record_budget(self, memory_budget: int) -> None:
        """Record the opener's memory budget (bytes) in the manifest, for ``inspect-state``."""
        self._manifest["memory_budget"] = memory_budget

    def mark_dirty(self) -> None:
        """Record, before the first write after a flush, that the files are about to change."""
        self._manifest["clean"] = False
        self._manifest["groups"] = self.groups
        self._write_manifest()

    def _refuse_broken(self) -> None:
        if self.broken is not None:
            raise StateError(
                f"a step stopped half-way ({self.broken}), so state_dir '{self.path}' may hold some "
                "parameters' updates and not others; it stays marked unclean",
                hint="restore the state directory from a checkpoint, or reopen it with "
                "allow_unclean=True to continue with the moments as they are",
            )

    def _committed(self) -> dict:
        """The manifest as a flush commits it now: the live step counters, clean."""
        params = {
            key: {**entry, "step": self.steps[key]} if key in self.steps else entry
            for key, entry in self._manifest["params"].items()
        }
        manifest = {
            **self._manifest,
            "params": params,
            "groups": self.groups,
            "clean": True,
            "last_writer": this_process(),
        }
        manifest.pop("checksum", None)
        return manifest

    def snapshot_manifest(self) -> bytes:
        """The bytes of the manifest a flush would commit now, nothing written: with the row
        files as this process sees them (:meth:`RowFile.copy_to`, a delta gathered from
        ``RowFile.record_bytes``), a checkpoint's copy of the state without a flush."""
        self._refuse_broken()
        return manifest_bytes(self._committed())

    def flush(self) -> None:
        """Make every row durable, then commit the step counters with a clean manifest."""
        if os.getpid() != self._owner:
            return
        self._refuse_broken()
        try:
            for row_file in self.files.values():
                row_file.flush()
            self._manifest = self._committed()
            atomic_write_bytes(self.path / MANIFEST, manifest_bytes(self._manifest))
        except OSError as e:
            self._manifest["clean"] = False
            raise StateError(
                f"could not flush state_dir '{self.path}': {e.strerror or e}; it stays marked unclean",
                hint="free disk space (or fix the disk) and flush again; the last committed state is intact",
            ) from e

    def close(self) -> None:
        for key, row_file in self.files.items():
            if key not in self._borrowed:
                row_file.close()
        self.files.clear()
        if os.getpid() == self._owner:  # the lock (shared with a forked child) stays the owner's
            self._lock.release()


def _refuse_foreign_files(path: Path) -> None:
    """A directory without a manifest may hold only our own leftovers, never a user's files."""
    stray = [
        p.name for p in path.iterdir() if p.name != DirectoryLock.FILE_NAME and not p.name.endswith(PENDING_SUFFIX)
    ]
    if stray:
        shown = ", ".join(sorted(stray)[:5]) + (" ..." if len(stray) > 5 else "")
        raise StateError(
            f"state_dir '{path}' has no {MANIFEST} but is not empty ({shown})",
            hint="point state_dir at a new or empty directory; if this was a state "
            f"directory, its {MANIFEST} is lost and it must be restored from a checkpoint",
        )


def _prepare_directory(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise StateError(
            f"state_dir '{path}' is a file, not a directory",
            hint="pass the path of a directory (it is created if it does not exist)",
        )
    if path.is_dir() and not (path / MANIFEST).exists():
        _refuse_foreign_files(path)  # before the lock file or the probe lands in it
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{uuid.uuid4().hex[:12]}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        probe.unlink()
    except OSError as e:
        raise StateError(
            f"state_dir '{path}' is not writable: {e.strerror}",
            hint="pick a directory on a writable disk with room for the moments (2 x the size of the embedding tables)",
        ) from e


def _steps_text(manifest: dict) -> str:
    steps = {k: e["step"] for k, e in manifest["params"].items()}
    return ", ".join(f"{k}: {s}" for k, s in steps.items()) or "no parameters"
