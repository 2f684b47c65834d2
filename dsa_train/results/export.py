"""Write a run's tables to files other tools read: ``.npy``, TSV, word2vec text, parquet.

Every table becomes a weights file and a names file (``<table>.names.tsv``: ``id<TAB>name``,
one line a row, in row order), with ``export.json`` saying what each file holds (the model,
its settings, the checkpoint step, each table's shape and the meaning of its columns). A table
is written as the model scores it: with ``model.normalize_entities``, each entity row divided by
its L2 norm (the checkpoint keeps the unscaled rows, which are the optimizer's), so that the
score function ``export.json`` states, applied to the exported vectors, is the model's. Tables
are streamed a chunk of rows at a time, so a table larger than RAM exports in bounded memory.
The folder is written under a temporary name next to the target, fsynced and renamed: a
failed or interrupted export leaves no folder under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from ..errors import DsaError
from ..fsutil import fsync_directory, fsync_path
from ..progress import work
from .names import INVERSE
from .reader import CHUNK_ROWS, TrainedRun
from .text_blobs import decimal, holds_tab_or_line_break, tab_lines

FORMATS = ("npy", "tsv", "word2vec", "parquet")
EXPORT_FORMAT = "dsa-train/export"
MANIFEST = "export.json"
PARTIAL = ".partial-export-"
MEANINGS = {
    ("node2vec", "nodes"): "node vectors (skip-gram input embeddings)",
    ("sage", "nodes"): "the learnable node features GraphSAGE aggregates",
    (
        "dlrm",
        "features",
    ): "rows of hashed categorical values (with model.recsys.tables: per_feature, feature f owns rows f x rows ... (f + 1) x rows - 1)",
}


def export_run(
    trained: TrainedRun,
    out: Path,
    fmt: str,
    *,
    force: bool = False,
    chunk_rows: int = CHUNK_ROWS,
) -> dict:
    """Write every table of ``trained`` to folder ``out`` in format ``fmt`` and return the
    manifest. ``force`` replaces ``out`` only if it is an earlier export (its ``export.json``
    says so); anything else there is refused. Each table's progress is reported as the work
    ``exporting TABLE`` (:mod:`dsa_train.progress`)."""
    if fmt not in FORMATS:
        raise DsaError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}", hint="e.g. --format npy")
    out = Path(out)
    _check_target(out, force)
    partial = out.parent / f"{PARTIAL}{out.name}-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        tables = {}
        for table, (rows, dim) in trained.tables.items():
            tables[table] = _export_table(trained, table, partial, fmt, chunk_rows)
            meaning = (
                trained.scoring.meanings.get(table, "embedding rows")
                if trained.scoring
                else MEANINGS.get((trained.kind, table), "embedding rows")
            )
            if _constraint(trained, table) is not None:
                meaning += "; each row scaled to unit L2 norm, as the model scores it (model.normalize_entities)"
            if table == "relations" and rows > trained.task.kg.num_relations:
                meaning += f"; rows {trained.task.kg.num_relations:,} on are the inverse relations head queries use, named {INVERSE}<name>"
            tables[table].update(rows=rows, dim=dim, dtype="float32", meaning=meaning)
        manifest = {
            "format": EXPORT_FORMAT,
            "version": 1,
            "run": str(trained.run.path.resolve()),
            "checkpoint": trained.step,
            "model": trained.kind,
            "settings": trained.settings,
            "dataset": trained.recipe.dataset.kind,
            "file_format": fmt,
            "tables": tables,
        }
        _write_file(partial / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
        fsync_directory(partial)
        _commit(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _check_target(out: Path, force: bool) -> None:
    if out.is_symlink():
        raise DsaError(
            f"output '{out}' is a symbolic link: export never writes through one",
            hint="give a real folder path with -o",
        )
    if not out.parent.is_dir():
        raise DsaError(
            f"the folder of output '{out}' does not exist", hint=f"create {out.parent} first, or pick another -o"
        )
    if out.exists():
        if not force:
            raise DsaError(
                f"output '{out}' already exists", hint="pick a new folder, or pass --force to replace an earlier export"
            )
        if not _is_export(out):
            raise DsaError(
                f"output '{out}' exists and is not an earlier export (no {MANIFEST} of format {EXPORT_FORMAT}): --force replaces only those",
                hint="pick a new folder; nothing in it was changed",
            )


def _is_export(folder: Path) -> bool:
    try:
        with open(folder / MANIFEST, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
            return json.loads(f.read(1 << 20)).get("format") == EXPORT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _commit(partial: Path, out: Path) -> None:
    """Rename ``partial`` to ``out``; an earlier export there goes only once the new one is in place."""
    old = None
    if out.exists():
        old = out.parent / f"{PARTIAL}{out.name}-old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(partial, out)
    fsync_directory(out.parent)
    if old is not None:
        shutil.rmtree(old)


def _constraint(trained: TrainedRun, table: str):
    """What the model applies to ``table``'s stored rows before it scores them, or ``None``:
    a knowledge-graph model's entity constraint (unit L2 rows with ``normalize_entities``)."""
    if table == "entities" and trained.scoring is not None and getattr(trained.model, "normalize_entities", False):
        return trained.model.constrain
    return None


def _scored_chunks(trained: TrainedRun, table: str, chunk_rows: int):
    """``(first_row, rows)`` pieces of ``table`` as the model scores them (see :func:`_constraint`)."""
    constrain = _constraint(trained, table)
    for start, block in trained.chunks(table, chunk_rows):
        yield start, block if constrain is None else constrain(block)


def _export_table(trained: TrainedRun, table: str, folder: Path, fmt: str, chunk_rows: int) -> dict:
    if fmt == "parquet":
        return _export_parquet(trained, table, folder, chunk_rows)
    rows, dim = trained.tables[table]
    names_file, weights_file = (
        f"{table}.names.tsv",
        {"npy": f"{table}.npy", "tsv": f"{table}.tsv", "word2vec": f"{table}.w2v.txt"}[fmt],
    )
    names, weights = _open_new(folder / names_file), _open_new(folder / weights_file)
    try:
        if fmt == "word2vec":
            weights.write(f"{rows} {dim}\n".encode())
        elif fmt == "npy":  # numpy's own header, then the rows in order: written, not faulted in through a mapping
            header = {
                "descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
                "fortran_order": False,
                "shape": (rows, dim),
            }
            np.lib.format.write_array_header_1_0(weights, header)
        for start, block in _scored_chunks(trained, table, chunk_rows):
            names.write(_names_lines(start, _names_of(trained, table, start, start + len(block))))
            values = block.numpy()
            if fmt == "npy":
                weights.write(np.ascontiguousarray(values, dtype=np.float32).data)
            elif fmt == "tsv":
                weights.write(_text_rows(values, "\t").encode())
            else:
                labels = trained.names(table, range(start, start + len(block)))
                spaced = next((n for n in labels if not n or any(c.isspace() for c in n)), None)
                if spaced is not None:
                    raise DsaError(
                        f"{table} name {spaced!r} is empty or holds white space, which word2vec text cannot hold",
                        hint="export --format npy or tsv (names go to a names file there)",
                    )
                lines = _text_rows(values, " ").splitlines()
                weights.write("".join(f"{n} {line}\n" for n, line in zip(labels, lines)).encode("utf-8"))
            work(f"exporting {table}", start + len(block), rows)
        for f in (names, weights):
            f.flush()
            os.fsync(f.fileno())
    finally:
        names.close()
        weights.close()
    return {"weights": weights_file, "names": names_file}


def _export_parquet(trained: TrainedRun, table: str, folder: Path, chunk_rows: int) -> dict:
    """``TABLE.parquet``: columns ``id`` (int64), ``name`` (string), ``vector`` (a fixed-size
    list of ``dim`` float32), one row group a chunk; the names file as for the other formats."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DsaError(
            "--format parquet needs pyarrow, which is not installed",
            hint='pip install "dsa-train[parquet]" (or pip install pyarrow)',
        ) from None
    rows, dim = trained.tables[table]
    names_file, weights_file = f"{table}.names.tsv", f"{table}.parquet"
    schema = pa.schema([("id", pa.int64()), ("name", pa.string()), ("vector", pa.list_(pa.float32(), dim))])
    names = _open_new(folder / names_file)
    sink = _open_new(folder / weights_file)
    try:
        with pq.ParquetWriter(sink, schema) as writer:
            for start, block in _scored_chunks(trained, table, chunk_rows):
                blob, offsets = _names_of(trained, table, start, start + len(block))
                names.write(_names_lines(start, (blob, offsets)))
                labels = pa.LargeStringArray.from_buffers(len(block), pa.py_buffer(offsets), pa.py_buffer(blob)).cast(
                    pa.string()
                )
                vectors = pa.FixedSizeListArray.from_arrays(pa.array(block.numpy().reshape(-1)), dim)
                ids = pa.array(np.arange(start, start + len(block), dtype=np.int64))
                writer.write_table(pa.Table.from_arrays([ids, labels, vectors], schema=schema))
                work(f"exporting {table}", start + len(block), rows)
        names.flush()
        os.fsync(names.fileno())
    finally:
        names.close()
        sink.close()  # (a no-op if the writer closed it)
    fsync_path(folder / weights_file)
    return {"weights": weights_file, "names": names_file}


def _names_of(trained: TrainedRun, table: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """The names of rows ``[start, stop)`` as a blob and offsets; a name holding a tab or a line
    break (which a names file cannot hold) is refused, naming it."""
    blob, offsets = trained.name_bytes(table, start, stop)
    if holds_tab_or_line_break(blob):
        bad = next(n for n in trained.names(table, range(start, stop)) if "\t" in n or "\n" in n or "\r" in n)
        raise DsaError(
            f"{table} name {bad!r} holds a tab or a line break, which a names file cannot hold",
            hint="rename it in the dataset",
        )
    return blob, offsets


def _names_lines(start: int, named: tuple[np.ndarray, np.ndarray]) -> bytes:
    """The names file's lines ``id<TAB>name`` of the rows from ``start`` named by ``named``."""
    return tab_lines(decimal(np.arange(start, start + len(named[1]) - 1)), named).tobytes()


def _text_rows(values: np.ndarray, sep: str) -> str:
    """Rows of float32 values as text that reads back to the same bits (9 significant digits)."""
    line = sep.join(["%.9g"] * values.shape[1]) + "\n"
    return "".join(line % tuple(row) for row in values.tolist())


def _open_new(path: Path):
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb")


def _write_file(path: Path, data: bytes) -> None:
    with _open_new(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
