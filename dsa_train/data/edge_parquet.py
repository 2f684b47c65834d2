"""Parquet edge files (one, or a folder of them, as Spark or pandas writes them): two id
columns (integers or strings) and an optional weight column, chosen by name or position,
read by pyarrow a record batch at a time and handed to :mod:`.edge_import` in the form its
text reader yields, so the same streaming, fingerprinted import numbers the nodes.

With ``ids: names`` a node's name is its string, or the decimal text of its integer (so the
same graph as a text file and as parquet imports alike); with ``ids: integers`` an integer
column holds the rows themselves and a string column must hold whole numbers. A null or
empty id, a negative integer id, a null or NaN weight is a ``DatasetError`` naming the file,
the column and the row (rows count from 0, as pandas and pyarrow count them).
pyarrow is the optional ``parquet`` extra; without it a parquet file is a named error.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError, DatasetError
from ..progress import work
from .edge_list import parse_integers
from .tsv import MAX_REPORTED

MAGIC = b"PAR1"
BATCH_ROWS = 1 << 20  # rows read at once
ROLES = ("source", "target", "weight")


def is_parquet(path: Path) -> bool:
    """Whether ``path`` is a parquet file (it starts with parquet's magic bytes)."""
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            "reading a parquet edge list needs pyarrow, which is not installed",
            hint='pip install "dsa-train[parquet]" (or pip install pyarrow)',
        ) from None
    return pa, pc, pq


@dataclass(frozen=True)
class ParquetEdges:
    """Which columns of the parquet files are the source, target and (if any) weight."""

    columns: tuple[str, ...]  # names, in the order source, target[, weight]
    types: tuple[str, ...]  # their arrow types, as the first file has them
    rows: int  # rows in all the files

    def describe(self) -> str:
        """One line for the user: what is read."""
        read = ", ".join(
            f"{role} = column {name!r} ({kind})" for role, name, kind in zip(ROLES, self.columns, self.types)
        )
        return f"parquet, {self.rows:,} rows: {read} (set dataset.edges.source/target/weight to change them)"


def parquet_format(files: list[Path], config) -> ParquetEdges:
    """The columns ``config`` (``dataset.edges``) names, checked in every file's schema.
    Raises ``ConfigError`` (a text-only setting, a column a file lacks) or ``DatasetError``
    (a file that is not parquet, a column of the wrong type, no rows)."""
    pa, _, pq = _pyarrow()
    text_only = [
        f"dataset.edges.{key}: applies to text edge lists, not to parquet ({files[0]}); leave it out"
        for key in ("delimiter", "header")
        if getattr(config, key) is not None
    ]
    if text_only:
        raise ConfigError(text_only)
    wanted = [(role, getattr(config, role)) for role in ROLES if getattr(config, role) is not None]
    names, types, rows = None, None, 0
    for path in files:
        if not is_parquet(path):
            raise DatasetError(
                f"'{path}' is not a parquet file, but '{files[0]}' is", hint="keep one format in an edge-list folder"
            )
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
        if names is None:
            names = [_column_name(path, schema.names, role, column) for role, column in wanted]
        for role, name in zip(ROLES, names):
            if name not in schema.names:
                raise ConfigError(
                    [f"dataset.edges.{role}: '{path}' has no column {name!r} (its columns: {', '.join(schema.names)})"],
                    hint="name a column every file has, or give its position (0 is the first)",
                )
            kind = schema.field(name).type
            if pa.types.is_dictionary(kind):
                kind = kind.value_type
            fits = _is_number(pa, kind) if role == "weight" else _is_id(pa, kind)
            if not fits:
                expected = "numbers" if role == "weight" else "integers or strings"
                raise DatasetError(
                    f"'{path}': column {name!r} ({role}) holds {kind}, not {expected}",
                    hint=f"point dataset.edges.{role} at a column of {expected}",
                )
        if types is None:
            types = tuple(str(schema.field(name).type) for name in names)
        rows += parquet.metadata.num_rows
    if not rows:
        raise DatasetError(
            f"parquet edge list '{files[0]}' has no rows"
            + (f" (nor the {len(files) - 1} other files)" if len(files) > 1 else ""),
            hint="check the file, or point dataset.path at another",
        )
    return ParquetEdges(tuple(names), types, rows)


def _column_name(path: Path, columns: list[str], role: str, column: int | str) -> str:
    if isinstance(column, str):
        return column
    if column >= len(columns):
        raise ConfigError(
            [
                f"dataset.edges.{role}: column {column} is past the {len(columns)} columns of '{path}' ({', '.join(columns)})"
            ],
            hint="positions count from 0; or name the column",
        )
    return columns[column]


def _is_id(pa, kind) -> bool:
    return (
        pa.types.is_integer(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or str(kind) == "string_view"
    )


def _is_number(pa, kind) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)


def parquet_chunks(
    files: list[Path], fmt: ParquetEdges, config, counts: dict, total: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every batch's edges as :mod:`.edge_import`'s text reader yields them: ``(text, (n, 2,
    2) start and length of each source and target name)``, or with ``ids: integers`` ``(text,
    (n, 2) ids)``; edges below ``min_weight`` left out and counted in ``counts``."""
    pa, pc, pq = _pyarrow()
    done = 0
    for path in files:
        parquet = pq.ParquetFile(path)
        size, rows, row = path.stat().st_size, max(1, parquet.metadata.num_rows), 0
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=list(fmt.columns), use_threads=True):
            ids = [batch.column(i) for i in range(2)]
            keep = None
            if len(fmt.columns) == 3:
                weights = _weights(pa, pc, path, fmt.columns[2], batch.column(2), row)
                if config.min_weight is not None:
                    keep = weights >= config.min_weight
                    counts["below_min_weight"] += int((~keep).sum())
            if config.ids == "integers":
                out = np.stack([_integers(pa, path, name, column, row) for name, column in zip(fmt.columns, ids)], 1)
                text = np.zeros(0, np.uint8)
                fields = out if keep is None else out[keep]
            else:
                (a, a_starts, a_lengths), (b, b_starts, b_lengths) = (
                    _strings(pa, path, name, column, row) for name, column in zip(fmt.columns, ids)
                )
                text = np.concatenate([a, b])
                fields = np.stack([np.stack([a_starts, a_lengths], 1), np.stack([b_starts + len(a), b_lengths], 1)], 1)
                if keep is not None:
                    fields = fields[keep]
            counts["input_edges"] += len(fields)  # as the text reader counts: the edges kept
            row += batch.num_rows
            work("reading the edges", done + size * row // rows, total)
            yield text, fields
        done += size


def _nulls(path: Path, name: str, column, first_row: int, what: str) -> None:
    """A ``DatasetError`` naming the rows where ``column`` is null."""
    if column.null_count:
        rows = np.flatnonzero(np.asarray(column.is_null()))[:MAX_REPORTED] + first_row
        raise DatasetError(
            f"'{path}': column {name!r} is null in row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows.tolist()))} (counting from 0)"
            + (" and more" if column.null_count > len(rows) else ""),
            hint=f"every edge needs {what}: drop or fill those rows",
        )


def _bad_rows(path: Path, name: str, bad: np.ndarray, first_row: int, problem: str, hint: str) -> None:
    if bad.any():
        rows = np.flatnonzero(bad)
        shown = ", ".join(map(str, (rows[:MAX_REPORTED] + first_row).tolist())) + (
            " and more" if len(rows) > MAX_REPORTED else ""
        )
        raise DatasetError(
            f"'{path}': column {name!r} {problem} in row{'s' if len(rows) > 1 else ''} {shown} (counting from 0)",
            hint=hint,
        )


def _strings(pa, path: Path, name: str, column, first_row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A column's values as text: the bytes, and each value's start and length in them
    (integers as their decimal text)."""
    _nulls(path, name, column, first_row, "a source and a target")
    if not pa.types.is_large_string(column.type):
        column = column.cast(pa.large_string())
    _, offsets, data = column.buffers()
    offsets = np.frombuffer(offsets, np.int64)[column.offset : column.offset + len(column) + 1]
    lengths = np.diff(offsets)
    _bad_rows(path, name, lengths == 0, first_row, "holds an empty name", "give every node a name")
    text = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
    return text, offsets[:-1].astype(np.int64), lengths


def _integers(pa, path: Path, name: str, column, first_row: int) -> np.ndarray:
    """A column's values as node rows (``ids: integers``): an integer column as it is, a
    string column's whole numbers parsed."""
    _nulls(path, name, column, first_row, "a source and a target")
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if pa.types.is_integer(column.type):
        values = column.to_numpy(zero_copy_only=False).astype(np.int64)
        _bad_rows(
            path,
            name,
            values < 0,
            first_row,
            "holds a negative id",
            "ids: integers reads rows 0 .. N-1; set dataset.edges.ids to 'names' to read any value as a name",
        )
        return values
    text, starts, lengths = _strings(pa, path, name, column, first_row)
    values, bad = parse_integers(text, starts, lengths)
    _bad_rows(
        path,
        name,
        bad,
        first_row,
        "holds a value that is not a whole number 0 .. 10^18",
        "dataset.edges.ids is 'integers'; set it to 'names' to read any text as a node's name",
    )
    return values


def _weights(pa, pc, path: Path, name: str, column, first_row: int) -> np.ndarray:
    _nulls(path, name, column, first_row, "a weight (the weight column is set)")
    values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
    _bad_rows(path, name, np.isnan(values), first_row, "holds NaN", "give every edge a number as its weight")
    return values
