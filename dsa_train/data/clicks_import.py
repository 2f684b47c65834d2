"""Reading a click log: a TSV or CSV file whose header names its columns, Criteo's layout the
model (``label``, dense ``I1``...``I13``, categorical ``C1``...``C26``).

Each line is one impression. The label is 0 or 1; a dense value is a number (empty: 0),
read as :math:`\\log(1 + \\max(x, 0))` with ``dense_log`` (DLRM's reading of Criteo's
counts); a categorical cell holds raw values (any text, empty: a missing value, an empty
bag), several separated by ``multi_hot``, each ``value:weight`` with ``weights`` (without ``:weight``, 1). Raw values
are stored as 63-bit fingerprints of their bytes (:mod:`.fingerprint`), the same in every
process and on every machine; the model hashes them into its table's rows, so the table's
size is the model's choice and the file is read once. The last lines are held out as the
valid and test splits, in file order (a click log is in time order: the model is tested on
the future). The file is read twice (counting lines, then parsing) and written chunk by
chunk (:class:`~.clicks.ClickWriter`): memory stays bounded however long it is.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import numpy as np

from ..errors import DatasetError
from ..recipe import ClickColumnsConfig
from .clicks import ClickWriter
from .fingerprint import fingerprints
from .store import SPLITS, DatasetWriter, Progress

#: 1: the first version.
IMPORTER_VERSION = 1
CHUNK = 1 << 15  # lines parsed at once
MAX_FIELD = 1 << 20  # longest cell csv accepts (its default, 128 KiB, is low for long bags)


def click_log_file(path: Path, looked: str | None = None) -> Path:
    """The click log's file, checked: a ``DatasetError`` says what to place where (``looked``:
    where the path was looked for)."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist" + (f": looked in {looked}" if looked else "")
        raise DatasetError(
            f"click log '{path}' {what}",
            hint="set dataset.path to a TSV or CSV file whose first line names its columns (label, I1..., C1... as in Criteo)",
        )
    return path


def delimiter_of(path: Path) -> str:
    return "," if path.suffix.lower() == ".csv" else "\t"


def _reader(stream, delimiter: str):
    csv.field_size_limit(MAX_FIELD)
    quoting = csv.QUOTE_MINIMAL if delimiter == "," else csv.QUOTE_NONE
    return csv.reader(stream, delimiter=delimiter, quoting=quoting, strict=True)


def columns_of(path: Path, header: list[str], config: ClickColumnsConfig, *, need_label: bool = True) -> tuple[int | None, list[int], list[int]]:
    """Positions of the label, dense and categorical columns named by the config (defaults:
    ``I<n>`` dense, ``C<n>`` categorical) in the header; a ``DatasetError`` names any missing
    (the label's position is ``None`` when it is missing and not ``need_label``)."""
    position = {name: i for i, name in enumerate(header)}
    dense = config.dense if config.dense is not None else [h for h in header if re.fullmatch(r"I\d+", h)]
    sparse = config.sparse if config.sparse is not None else [h for h in header if re.fullmatch(r"C\d+", h)]
    label = [config.label] if need_label or config.label in position else []
    missing = [name for name in [*label, *dense, *sparse] if name not in position]
    shown = ", ".join(header[:8]) + (", ..." if len(header) > 8 else "")
    if missing:
        raise DatasetError(
            f"click log '{path}' has no column {', '.join(repr(m) for m in missing[:5])} (its header: {shown})",
            hint="name the columns in dataset.columns.label, .dense and .sparse as the file's first line spells them",
        )
    if not sparse:
        raise DatasetError(
            f"click log '{path}' has no categorical column (none named C<number>, and dataset.columns.sparse is not set; header: {shown})",
            hint="list the categorical columns in dataset.columns.sparse",
        )
    return position[config.label] if label else None, [position[n] for n in dense], [position[n] for n in sparse]


def _count_lines(path: Path) -> int:
    """Lines after the header that hold anything."""
    with open(path, "rb") as f:
        f.readline()
        return sum(1 for line in f if line.strip())


def write_click_log(writer: DatasetWriter, *, path: Path, config: ClickColumnsConfig, progress: Progress | None = None) -> None:
    """Import the click log at ``path`` into ``writer`` (see the module docstring)."""
    total = _count_lines(path)
    valid, test = (round(total * fraction) for fraction in config.holdout)
    bounds = np.cumsum([total - valid - test, valid, test])  # end of each split, in data lines
    chunks = read_click_chunks(path, config)
    features, dense_features = next(chunks)
    out = ClickWriter(writer, features=features, dense_features=dense_features, weighted=config.weights)
    done = 0
    for parsed in chunks:
        _append_by_split(out, parsed, done, bounds)
        done += len(parsed[0])
        if progress is not None:
            progress(f"reading {path.name}", done, total)
    out.finish()


def read_click_chunks(path: Path, config: ClickColumnsConfig, *, need_label: bool = True):
    """The click log at ``path`` as it is parsed: first ``(features, dense_features)``, the
    header's names, then ``(labels, dense, lengths, ids, weights)`` per chunk of impressions.
    Without ``need_label`` a file whose header lacks the label column is read too (its labels
    are all 0): impressions to score, not to train on."""
    delimiter = delimiter_of(path)
    with open(path, encoding="utf-8", newline="", errors="strict") as stream:
        try:
            rows = _reader(stream, delimiter)
            header = next(rows, None)
            if not header:
                raise DatasetError(f"click log '{path}' is empty", hint="its first line names the columns, each further line is one impression")
            header = [h.strip() for h in header]
            label, dense, sparse = columns_of(path, header, config, need_label=need_label)
            yield [header[i] for i in sparse], [header[i] for i in dense]
            parser = _Parser(path, len(header), label, dense, sparse, config)
            while True:
                chunk, numbers = [], []
                for row in rows:
                    if not row or (len(row) == 1 and not row[0].strip()):
                        continue
                    chunk.append(row)
                    numbers.append(rows.line_num)
                    if len(chunk) == CHUNK:
                        break
                if not chunk:
                    break
                yield parser.parse(chunk, numbers)
        except UnicodeDecodeError as e:
            raise DatasetError(f"click log '{path}' is not UTF-8 text (byte {e.start} of a block: {e.reason})", hint="convert it to UTF-8") from None
        except csv.Error as e:
            raise DatasetError(f"click log '{path}', line {rows.line_num}: {e}", hint="fix that line (a stray quote, or a cell over 1 MiB)") from None


def _append_by_split(out: ClickWriter, parsed: tuple, first: int, bounds: np.ndarray) -> None:
    """Hand the chunk's impressions (data lines ``first``...) to the splits they fall in."""
    labels, dense, lengths, ids, weights = parsed
    ends = np.concatenate([[0], np.cumsum(lengths.sum(1))])
    n = len(labels)
    for split, bound, previous in zip(SPLITS, bounds, np.concatenate([[0], bounds[:-1]]), strict=True):
        low, high = max(int(previous) - first, 0), min(int(bound) - first, n)
        if low >= high:
            continue
        part = slice(int(ends[low]), int(ends[high]))
        out.append(split, labels[low:high], dense[low:high], lengths[low:high], ids[part], None if weights is None else weights[part])


class _Parser:
    """Turns a chunk of rows (lists of cells) into arrays, naming the line of any bad cell."""

    def __init__(self, path: Path, width: int, label: int | None, dense: list[int], sparse: list[int], config: ClickColumnsConfig) -> None:
        self.path, self.width, self.label, self.dense, self.sparse, self.config = path, width, label, dense, sparse, config

    def _bad(self, line: int, what: str, hint: str) -> DatasetError:
        return DatasetError(f"click log '{self.path}', line {line}: {what}", hint=hint)

    def parse(self, rows: list[list[str]], lines: list[int]):
        c = self.config
        n, f = len(rows), len(self.sparse)
        labels = np.empty(n, np.uint8)
        dense = np.zeros((n, len(self.dense)), np.float32)
        lengths = np.zeros((n, f), np.int64)
        tokens: list[bytes] = []
        weights: list[float] = []
        for r, (row, line) in enumerate(zip(rows, lines, strict=True)):
            if len(row) != self.width:
                raise self._bad(line, f"{len(row)} cells where the header names {self.width}", "give every line one cell per header column (empty cells are missing values)")
            if self.label is not None:
                value = row[self.label].strip()
                if value not in ("0", "1"):
                    raise self._bad(line, f"label {value!r} in column '{c.label}' is not 0 or 1", "a label is 1 (clicked) or 0")
                labels[r] = value == "1"
            else:
                labels[r] = 0
            for j, column in enumerate(self.dense):
                cell = row[column].strip()
                if cell:
                    try:
                        dense[r, j] = float(cell)
                    except ValueError:
                        raise self._bad(line, f"dense value {cell!r} is not a number", "dense cells hold numbers, or nothing") from None
            for j, column in enumerate(self.sparse):
                cell = row[column]
                if not cell:
                    continue
                for token in cell.split(c.multi_hot):
                    if not token:
                        continue
                    if c.weights:
                        token, _, weight = token.rpartition(":") if ":" in token else (token, "", "1")
                        try:
                            weights.append(float(weight))
                        except ValueError:
                            raise self._bad(line, f"weight {weight!r} of a value is not a number", "write each value as value:weight") from None
                        if not math.isfinite(weights[-1]):
                            raise self._bad(line, f"weight {weight!r} is not finite", "write each value as value:weight, a finite weight")
                    tokens.append(token.encode())
                    lengths[r, j] += 1
        if c.dense_log:
            dense = np.log1p(np.maximum(dense, 0))
        if not np.isfinite(dense).all():
            bad = int(np.flatnonzero(~np.isfinite(dense).all(1))[0])
            raise self._bad(lines[bad], "a dense value is infinite or NaN", "dense cells hold finite numbers")
        sizes = np.fromiter((len(t) for t in tokens), np.int64, len(tokens))
        starts = np.zeros(len(tokens), np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        buffer = np.frombuffer(b"".join(tokens), np.uint8) if tokens else np.zeros(0, np.uint8)
        ids = (fingerprints(buffer, starts, sizes)[:, 0] >> np.uint64(1)).astype(np.int64)
        return labels, dense, lengths, ids, np.asarray(weights, np.float32) if c.weights else None

