"""Reading a click log: a TSV or CSV file (gzip-compressed when its name ends in ``.gz``)
whose first line names its columns, or whose columns ``dataset.columns.names`` lists (Criteo's
own files: ``dataset.layout: criteo``, label, ``I1``...``I13``, ``C1``...``C26``, tabs, no
header). The delimiter is read from the first line (a tab if it holds one, else a comma), never
from the file's extension, unless ``dataset.columns.delimiter`` names it; the import says which
it used, and which columns are the label, dense and categorical ones (by default every column
but the label, the dense ``I<n>`` ones and an ``id``: Avazu's 22 categorical columns, all of them).

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
import dataclasses
import gzip
import logging
import math
import re
from pathlib import Path

import numpy as np

from ..errors import DatasetError
from ..progress import work
from ..recipe import ClickColumnsConfig, DatasetConfig
from .clicks import ClickWriter
from .fingerprint import fingerprints
from .store import SPLITS, DatasetWriter

logger = logging.getLogger(__name__)

#: 1: the first version. 2: every non-dense column categorical by default; headerless files; gzip.
IMPORTER_VERSION = 2
#: Criteo's column order (Kaggle's train.txt, the Terabyte day_N files): no header, tabs.
CRITEO = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
ROW_ID = "id"  # a row id column: never a feature by default
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


def click_columns(config: DatasetConfig) -> ClickColumnsConfig:
    """``dataset.columns`` with ``dataset.layout``'s settings filled in where not set."""
    columns = config.columns
    if config.layout == "criteo":
        columns = dataclasses.replace(columns, names=columns.names or list(CRITEO), delimiter=columns.delimiter or "\t")
    return columns


def open_text(path: Path):
    """The file as UTF-8 text (through gzip when its name ends in ``.gz``)."""
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="", errors="strict")
    return open(path, encoding="utf-8", newline="", errors="strict")


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def delimiter_of(path: Path, config: ClickColumnsConfig) -> tuple[str, str]:
    """The delimiter, and where it came from: the recipe's, else read from the first line (a
    tab if it holds one, else a comma)."""
    if config.delimiter is not None:
        return config.delimiter, "given by the recipe (dataset.columns.delimiter or dataset.layout)"
    try:
        with _open_bytes(path) as f:
            first = f.readline(MAX_FIELD)
    except (OSError, EOFError) as e:
        raise DatasetError(
            f"click log '{path}' cannot be read: {e}", hint="check the file (a .gz name must hold gzip data)"
        ) from None
    if b"\t" in first:
        return "\t", "read from the first line, which holds tabs"
    if b"," in first:
        return ",", "read from the first line, which holds commas and no tab"
    raise DatasetError(
        f"click log '{path}': its first line holds neither a tab nor a comma ({first[:80]!r})",
        hint="set dataset.columns.delimiter to the character between its cells",
    )


def _reader(stream, delimiter: str):
    csv.field_size_limit(MAX_FIELD)
    quoting = csv.QUOTE_MINIMAL if delimiter == "," else csv.QUOTE_NONE
    return csv.reader(stream, delimiter=delimiter, quoting=quoting, strict=True)


def columns_of(
    path: Path, header: list[str], config: ClickColumnsConfig, *, need_label: bool = True
) -> tuple[int | None, list[int], list[int]]:
    """Positions of the label, dense and categorical columns named by the config (defaults:
    ``I<n>`` dense, ``C<n>`` categorical) in the header; a ``DatasetError`` names any missing
    (the label's position is ``None`` when it is missing and not ``need_label``)."""
    position = {name: i for i, name in enumerate(header)}
    dense = config.dense if config.dense is not None else [h for h in header if re.fullmatch(r"I\d+", h)]
    if config.sparse is not None:
        sparse = config.sparse
    else:
        sparse = [h for h in header if h not in (config.label, *dense) and h.lower() != ROW_ID]
    label = [config.label] if need_label or config.label in position else []
    missing = [name for name in [*label, *dense, *sparse] if name not in position]
    shown = ", ".join(header[:8]) + (", ..." if len(header) > 8 else "")
    if missing:
        raise DatasetError(
            f"click log '{path}' has no column {', '.join(repr(m) for m in missing[:5])} (its header: {shown})",
            hint="name the columns in dataset.columns.label, .dense and .sparse as the file's header (or dataset.columns.names) spells them",
        )
    if not sparse:
        raise DatasetError(
            f"click log '{path}' has no categorical column (every column is the label or dense; header: {shown})",
            hint="list the categorical columns in dataset.columns.sparse",
        )
    return position[config.label] if label else None, [position[n] for n in dense], [position[n] for n in sparse]


def _count_lines(path: Path, header: bool) -> int:
    """Lines after the header (if any) that hold anything."""
    with _open_bytes(path) as f:
        if header:
            f.readline()
        return sum(1 for line in f if line.strip())


def write_click_log(writer: DatasetWriter, *, path: Path, config: ClickColumnsConfig) -> None:
    """Import the click log at ``path`` into ``writer`` (see the module docstring), saying (in
    the log) how the file is read."""
    chunks = read_click_chunks(path, config)
    features, dense_features = next(chunks)
    logger.info(chunks.description)
    total = _count_lines(path, chunks.header)  # type: ignore[attr-defined]
    valid, test = (round(total * fraction) for fraction in config.holdout)
    bounds = np.cumsum([total - valid - test, valid, test])  # end of each split, in data lines
    out = ClickWriter(writer, features=features, dense_features=dense_features, weighted=config.weights)
    done = 0
    for parsed in chunks:
        _append_by_split(out, parsed, done, bounds)
        done += len(parsed[0])
        work(f"reading {path.name}", done, total)
    out.finish()


class _Chunks:
    """The generator of :func:`read_click_chunks`, with ``header``: whether the file has one,
    and ``description``: how it is read, in words (both known once the first item is taken)."""

    def __init__(self, generator, state: dict) -> None:
        self._generator, self._state = generator, state

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._generator)

    @property
    def header(self) -> bool:
        return self._state["header"]

    @property
    def description(self) -> str:
        return self._state["description"]


def read_click_chunks(path: Path, config: ClickColumnsConfig, *, need_label: bool = True) -> _Chunks:
    """The click log at ``path`` as it is parsed: first ``(features, dense_features)``, the
    columns' names, then ``(labels, dense, lengths, ids, weights)`` per chunk of impressions.
    Without ``need_label`` a file that lacks the label column is read too (its labels are all
    0): impressions to score, not to train on."""
    state: dict = {"header": True}
    return _Chunks(_read_click_chunks(path, config, need_label, state), state)


def _read_click_chunks(path: Path, config: ClickColumnsConfig, need_label: bool, state: dict):
    delimiter, source = delimiter_of(path, config)
    with open_text(path) as stream:
        try:
            rows = _reader(stream, delimiter)
            first = next(rows, None)
            if not first:
                raise DatasetError(
                    f"click log '{path}' is empty",
                    hint="each line is one impression (after a header naming the columns, if any)",
                )
            cells = [c.strip() for c in first]
            header = config.header if config.header is not None else (config.label in cells or config.names is None)
            state["header"] = header
            if header:
                names = cells
            elif config.names is None:
                raise DatasetError(
                    f"click log '{path}' has no header (dataset.columns.header: false) and dataset.columns.names is not set",
                    hint="list the columns in order in dataset.columns.names, or set dataset.layout: criteo for Criteo's own files",
                )
            else:
                names = list(config.names)
                rows = _Resumed(first, rows)
            label, dense, sparse = columns_of(path, names, config, need_label=need_label)
            state["description"] = _describe(path, delimiter, source, header, names, label, dense, sparse)
            yield [names[i] for i in sparse], [names[i] for i in dense]
            parser = _Parser(path, len(names), label, dense, sparse, config)
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
            raise DatasetError(
                f"click log '{path}' is not UTF-8 text (byte {e.start} of a block: {e.reason})",
                hint="convert it to UTF-8",
            ) from None
        except (OSError, EOFError) as e:  # a damaged .gz
            raise DatasetError(
                f"click log '{path}' cannot be read: {e}", hint="check the file (a .gz name must hold whole gzip data)"
            ) from None
        except csv.Error as e:
            raise DatasetError(
                f"click log '{path}', line {rows.line_num}: {e}",
                hint="fix that line (a stray quote, or a cell over 1 MiB)",
            ) from None


class _Resumed:
    """A csv reader with its first row given back (a file without a header: it is data)."""

    def __init__(self, first: list[str], rows) -> None:
        self._first, self._rows = first, rows

    @property
    def line_num(self) -> int:
        return self._rows.line_num

    def __iter__(self):
        return self

    def __next__(self):
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return next(self._rows)


def _describe(
    path: Path, delimiter: str, source: str, header: bool, names: list[str], label, dense: list[int], sparse: list[int]
) -> str:
    """How the file is read, in one line: the delimiter and where it came from, the header,
    and the columns of each role, with those left out."""
    used = {label, *dense, *sparse}
    ignored = [n for i, n in enumerate(names) if i not in used]
    shown = {"\t": "tab", ",": "comma"}.get(delimiter, repr(delimiter))
    return (
        f"click log '{path.name}': {shown}-separated ({source}; dataset.columns.delimiter changes it), "
        f"{'a header' if header else 'no header (columns from dataset.columns.names)'}, label '{names[label] if label is not None else '-'}', "
        f"{len(dense)} dense, {len(sparse)} categorical ({', '.join(names[i] for i in sparse[:30])}{', ...' if len(sparse) > 30 else ''})"
        + (
            f"; ignored: {', '.join(ignored)} (list them in dataset.columns.sparse or .dense to use them)"
            if ignored
            else ""
        )
    )


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
        out.append(
            split,
            labels[low:high],
            dense[low:high],
            lengths[low:high],
            ids[part],
            None if weights is None else weights[part],
        )


class _Parser:
    """Turns a chunk of rows (lists of cells) into arrays, naming the line of any bad cell."""

    def __init__(
        self, path: Path, width: int, label: int | None, dense: list[int], sparse: list[int], config: ClickColumnsConfig
    ) -> None:
        self.path, self.width, self.label, self.dense, self.sparse, self.config = (
            path,
            width,
            label,
            dense,
            sparse,
            config,
        )

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
                raise self._bad(
                    line,
                    f"{len(row)} cells where the header names {self.width}",
                    "give every line one cell per header column (empty cells are missing values)",
                )
            if self.label is not None:
                value = row[self.label].strip()
                if value not in ("0", "1"):
                    raise self._bad(
                        line, f"label {value!r} in column '{c.label}' is not 0 or 1", "a label is 1 (clicked) or 0"
                    )
                labels[r] = value == "1"
            else:
                labels[r] = 0
            for j, column in enumerate(self.dense):
                cell = row[column].strip()
                if cell:
                    try:
                        dense[r, j] = float(cell)
                    except ValueError:
                        raise self._bad(
                            line, f"dense value {cell!r} is not a number", "dense cells hold numbers, or nothing"
                        ) from None
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
                            raise self._bad(
                                line,
                                f"weight {weight!r} of a value is not a number",
                                "write each value as value:weight",
                            ) from None
                        if not math.isfinite(weights[-1]):
                            raise self._bad(
                                line,
                                f"weight {weight!r} is not finite",
                                "write each value as value:weight, a finite weight",
                            )
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
