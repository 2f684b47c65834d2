r"""The filter index of filtered ranking: every true triple, sorted on disk, looked up by query.

Filtered link prediction removes from a query's candidates every *other* entity that makes a
known true triple (any split). For a tail query :math:`(h, r, ?)` those are the :math:`t` of
all true :math:`(h, r, t)`; for a head query :math:`(?, r, t)` the :math:`h` of all true
:math:`(h, r, t)`. The index keeps, per side, the pairs (query, answer) with

.. math::
    \text{tail side: } q = h \cdot R + r,\ a = t \qquad
    \text{head side: } q = t \cdot R + r,\ a = h

sorted by :math:`(q, a)`, in two columns. With :math:`E` entities and :math:`R` relations,
:math:`q \le (E - 1) R + (R - 1) = E R - 1`, so the query column cannot overflow int64
whenever :math:`E R < 2^{63}` (checked; otherwise a :class:`DatasetError`); one key
:math:`(h R + r) E + t` would need :math:`E^2 R < 2^{63}`, which fails at :math:`E = 10^8`.

A folder written by :func:`write_triple_index`::

    index.json        {"format": "dsa-train-triple-index", "version": 1, "num_entities": E,
                       "num_relations": R, "rows": n, "dtypes": {"query": "<i8", "answer": ...},
                       "files": {"tail": {"query": ..., "answer": ...}, "head": {...}}}
    tail.query.npy    (n,) int64   h * R + r, ascending
    tail.answer.npy   (n,) int32   t (int64 when E > 2^31), ascending within each query
    head.query.npy    (n,) int64   t * R + r, ascending
    head.answer.npy   (n,) int32   h, ascending within each query

Duplicate triples collapse: each distinct triple is one row, so both sides hold the same
``n`` rows. :meth:`TripleIndex.known` finds a query's rows with two binary searches on the
memory-mapped query column (:math:`2 \lceil\log_2 n\rceil` comparisons, a few page reads when cold) and gathers only those rows
of the answer column.

**The build** is an external-memory distribution sort whose RAM stays within
``memory_bytes`` whatever the number of triples. Pass 1 over the chunks validates the ids
and counts rows per query range (a histogram of at most :math:`2^{16}` bins per side); the
bins are cut greedily into buckets of at most ``capacity`` rows. Pass 2 appends each row to
its bucket's temporary file. Each bucket is then sorted in RAM as one int64 key
:math:`(q - q_{lo}) E + a`, deduplicated and appended to the output columns; a bucket with
more rows than fit (a hub query, or more triples than 256 buckets hold), or whose query
span :math:`S` would overflow the key (:math:`S E \ge 2^{63}`), is distributed again over
finer bins (by answer once it holds a single query). Disk: about 2 x 12 bytes per triple of
temporary files at peak (16 when E > 2^31) plus the index itself (2 x 12 bytes per distinct
triple, 2 x 16 when E > 2^31).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import DatasetError
from ..fsutil import atomic_write_bytes, fsync_directory, read_json_object
from .store import npy_header

FORMAT = "dsa-train-triple-index"
VERSION = 1
MANIFEST = "index.json"
SIDES = ("tail", "head")
COLUMNS = ("query", "answer")
FILES = {side: {column: f"{side}.{column}.npy" for column in COLUMNS} for side in SIDES}
QUERY_DTYPE = np.dtype("<i8")
KEY_LIMIT = 1 << 63  # every key, query and sort key stays below this

MIN_MEMORY = 4096
MAX_BUCKETS = 256  # buckets a distribution aims at when not all fit in RAM, so its writes stay large
_MAX_BIN_BITS = 16
_SORT_ROW_BYTES = 32  # RAM per row while a bucket is sorted: records, then key, kept mask, columns
_DISTRIBUTE_ROW_BYTES = 128  # RAM per row while a slice is distributed: staged triple, records, bins, order


def answer_dtype(num_entities: int) -> np.dtype:
    """int32 when every entity id (< E) fits it, else int64."""
    return np.dtype("<i4") if num_entities <= 1 << 31 else np.dtype("<i8")


def check_sizes(num_entities: int, num_relations: int) -> None:
    """Refuse sizes whose query ``anchor * R + relation`` could overflow int64."""
    for name, value in (("num_entities", num_entities), ("num_relations", num_relations)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise DatasetError(
                f"the filter index needs a positive integer {name}, got {value!r}", hint="pass the dataset's counts"
            )
    if num_entities * num_relations >= KEY_LIMIT:
        raise DatasetError(
            f"the filter index cannot key {num_entities:,} entities x {num_relations:,} relations: "
            f"its query id anchor * {num_relations:,} + relation would reach {num_entities * num_relations:,}, "
            f"beyond int64 (2^63 = {KEY_LIMIT:,})",
            hint="renumber the entities and relations densely from 0 (only ids that occur); "
            "num_entities x num_relations must stay below 2^63",
        )


def write_triple_index(
    directory: Path,
    chunks: Callable[[], Iterable[np.ndarray]],
    num_entities: int,
    num_relations: int,
    *,
    memory_bytes: int = 256 << 20,
) -> None:
    """Write the filter index of every triple ``chunks()`` yields into ``directory``.

    ``chunks()`` yields ``(k, 3)`` integer arrays (int32 or int64; tensors convert) of
    (head, relation, tail) ids, all splits together; it is called twice (count, then
    distribute) and must yield the same triples both times. ``directory`` is created if
    missing; the four columns are written under temporary names, fsynced and renamed, and
    ``index.json`` last, so a reader finds a complete index or none (an old manifest is
    removed before its files are replaced). Sorting RAM stays within ``memory_bytes``
    (the caller's chunks not counted); temporary files live in ``directory/.sort-*``.
    Raises :class:`DatasetError` for an id out of range, sizes that could overflow, or
    chunks that changed between calls.
    """
    check_sizes(num_entities, num_relations)
    if memory_bytes < MIN_MEMORY:
        raise ValueError(f"memory_bytes must be at least {MIN_MEMORY}, got {memory_bytes}")
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file there: refused just below
        pass
    if not stat.S_ISDIR(os.lstat(directory).st_mode):
        raise DatasetError(
            f"the filter index folder '{directory}' is not a folder (a symbolic link or a file)",
            hint="pass a real folder or a new path; dsa-train never writes through a link it did not create",
        )
    builder = _Builder(directory, num_entities, num_relations, memory_bytes)
    try:
        builder.build(chunks)
    finally:
        builder.discard()


class TripleIndex:
    """Every known true triple, sorted by query per side, for looking up a query's true answers.

    ``TripleIndex(triples, E, R)`` and :meth:`from_triples` build one in memory;
    :meth:`open` maps a folder written by :func:`write_triple_index`. Both hold the same
    columns (see the module docstring) and answer :meth:`known` with the same code.
    """

    num_entities: int
    num_relations: int
    rows: int

    def __init__(self, triples: Tensor, num_entities: int, num_relations: int) -> None:
        """In memory: built through a temporary folder (same build, same layout), then read into RAM."""
        triples = torch.as_tensor(triples).cpu()
        with tempfile.TemporaryDirectory(prefix="dsa-triple-index-") as tmp:
            write_triple_index(Path(tmp), lambda: [triples.numpy()], num_entities, num_relations)
            mapped = TripleIndex.open(tmp)
            in_ram = {side: tuple(column.numpy().copy() for column in mapped._columns[side]) for side in SIDES}
            self._attach(mapped.num_entities, mapped.num_relations, in_ram)

    @classmethod
    def from_triples(cls, triples: Tensor, num_entities: int, num_relations: int) -> TripleIndex:
        """The index of an ``(M, 3)`` tensor of (head, relation, tail) ids, in RAM."""
        return cls(triples, num_entities, num_relations)

    @classmethod
    def open(cls, directory: Path | str) -> TripleIndex:
        """Map the index in ``directory`` read-only, after checking its manifest and file sizes.

        Nothing is read but the headers: lookups page in what they touch. Raises
        :class:`DatasetError` for a missing or foreign manifest, another version, a missing
        file, a link, or a file whose dtype or length differs from the manifest.
        """
        directory = Path(directory)
        manifest = _read_manifest(directory)
        index = cls.__new__(cls)
        columns = {}
        for side in SIDES:
            columns[side] = tuple(
                _map_column(directory / FILES[side][column], np.dtype(manifest["dtypes"][column]), manifest["rows"])
                for column in COLUMNS
            )
        index._attach(manifest["num_entities"], manifest["num_relations"], columns)
        return index

    def _attach(self, num_entities: int, num_relations: int, columns: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.num_entities, self.num_relations = num_entities, num_relations
        self.rows = len(columns["tail"][0])
        with warnings.catch_warnings():  # a read-only map: nothing here ever writes to it
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            # torch's searchsorted is about 4x faster than numpy's, over a map as over RAM
            self._columns = {side: tuple(torch.from_numpy(column) for column in pair) for side, pair in columns.items()}

    def queries(self, side: str) -> Tensor:
        """The distinct query keys of a side, ascending (int64): ``anchor * R + relation``."""
        return torch.unique_consecutive(self._columns[side][0])

    def known(self, anchor: Tensor, relation: Tensor, side: str) -> tuple[Tensor, Tensor]:
        """All (query number, entity) pairs where the entity answers query ``i`` truly.

        Query ``i`` is ``(anchor[i], relation[i], ?)`` for ``side="tail"`` and
        ``(?, relation[i], anchor[i])`` for ``side="head"``. Pairs come grouped by query
        number, entities ascending within each; both are int64 tensors.
        """
        if side not in self._columns:
            raise ValueError(f"side must be 'tail' or 'head', got {side!r}")
        queries, answers = self._columns[side]
        q = torch.as_tensor(anchor).cpu().long() * self.num_relations + torch.as_tensor(relation).cpu().long()
        lo = torch.searchsorted(queries, q)
        counts = torch.searchsorted(queries, q, right=True) - lo
        query = torch.repeat_interleave(torch.arange(len(q)), counts)
        starts = torch.repeat_interleave(lo - (torch.cumsum(counts, 0) - counts), counts)
        return query, answers[starts + torch.arange(len(query))].long()


# --- reading -----------------------------------------------------------------------------


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    manifest = read_json_object(path)
    rebuild = "rebuild it: write_triple_index (the dataset import) writes the whole folder again"
    if manifest is None:
        raise DatasetError(
            f"'{path}' is missing or not a JSON object (a filter index folder is only complete once it is written)",
            hint=f"{rebuild}; pass the folder that holds {MANIFEST} and the .npy columns",
        )
    if manifest.get("format") != FORMAT:
        raise DatasetError(f"'{path}' describes {manifest.get('format')!r}, not a {FORMAT}", hint=rebuild)
    if manifest.get("version") != VERSION:
        raise DatasetError(
            f"'{path}' is version {manifest.get('version')!r} of the filter index; this dsa-train reads version {VERSION}",
            hint=rebuild,
        )
    counts = {k: manifest.get(k) for k in ("num_entities", "num_relations", "rows")}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in counts.values()) or not (
        0 < counts["num_entities"] * counts["num_relations"] < KEY_LIMIT
    ):
        raise DatasetError(
            f"'{path}' has counts {counts}, not those of an index (integers, E * R in [1, 2^63))", hint=rebuild
        )
    expected = {"query": QUERY_DTYPE.str, "answer": answer_dtype(counts["num_entities"]).str}
    if manifest.get("dtypes") != expected or manifest.get("files") != FILES:
        raise DatasetError(
            f"'{path}' names dtypes {manifest.get('dtypes')} and files {manifest.get('files')}; an index of "
            f"{counts['num_entities']:,} entities has dtypes {expected} and files {FILES}",
            hint=rebuild,
        )
    return {**counts, "dtypes": expected}


def _map_column(path: Path, dtype: np.dtype, rows: int) -> np.ndarray:
    """The ``(rows,)`` array of ``dtype`` in the .npy file ``path``, memory-mapped read-only."""
    hint = "rebuild the index: write_triple_index (the dataset import) writes the whole folder again"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # never through a link, never stuck on a FIFO
    except OSError as e:
        raise DatasetError(f"cannot open '{path}' of the filter index: {e.strerror}", hint=hint) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise DatasetError(f"'{path}' is not a regular file", hint=hint)
        try:
            if np.lib.format.read_magic(f) != (1, 0):
                raise ValueError("not a version 1.0 .npy file")
            shape, fortran, found = np.lib.format.read_array_header_1_0(f)
        except ValueError as e:
            raise DatasetError(f"'{path}' is not a .npy column the index wrote ({e})", hint=hint) from None
        offset = f.tell()
        if shape != (rows,) or fortran or found != dtype or info.st_size != offset + rows * dtype.itemsize:
            raise DatasetError(
                f"'{path}' holds shape {shape} of {found} in {info.st_size:,} bytes; the manifest says "
                f"({rows},) of {dtype} in {offset + rows * dtype.itemsize:,} bytes (a torn or foreign file)",
                hint=hint,
            )
        if rows == 0:  # mmap cannot map zero bytes
            return np.empty(0, dtype)
        return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=(rows,))


# --- building ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Range:
    """The rows whose query lies in ``[q_lo, q_hi)`` and, when that is one query, whose
    answer lies in ``[a_lo, a_hi)``. Bins split the queries, or the answers of one query."""

    q_lo: int
    q_hi: int
    a_lo: int
    a_hi: int

    @property
    def by_answer(self) -> bool:
        return self.q_hi - self.q_lo == 1

    @property
    def span(self) -> int:
        """How many values the bins divide: answers of the one query, else queries."""
        return self.a_hi - self.a_lo if self.by_answer else self.q_hi - self.q_lo

    def shift(self, bits: int) -> int:
        """Bins of ``2^shift`` values, so that at most ``2^bits`` cover the span."""
        return max(0, (self.span - 1).bit_length() - bits)

    def bins(self, records: np.ndarray, shift: int) -> np.ndarray:
        column, lo = ("answer", self.a_lo) if self.by_answer else ("query", self.q_lo)
        bins = np.subtract(records[column], lo, dtype=np.int64)
        return np.right_shift(bins, shift, out=bins)

    def part(self, first_bin: int, end_bin: int, shift: int) -> _Range:
        """The sub-range of bins ``[first_bin, end_bin)``."""
        if self.by_answer:
            return _Range(
                self.q_lo, self.q_hi, self.a_lo + (first_bin << shift), min(self.a_lo + (end_bin << shift), self.a_hi)
            )
        q_lo, q_hi = self.q_lo + (first_bin << shift), min(self.q_lo + (end_bin << shift), self.q_hi)
        return _Range(q_lo, q_hi, self.a_lo, self.a_hi)


@dataclass
class _Bucket:
    range: _Range
    rows: int
    path: Path
    first_bin: int = 0


class _Builder:
    """One build: the temporary folder, the output columns, and the sort."""

    def __init__(self, directory: Path, num_entities: int, num_relations: int, memory_bytes: int) -> None:
        self.directory, self.E, self.R = directory, num_entities, num_relations
        self.records = np.dtype([("query", QUERY_DTYPE), ("answer", answer_dtype(num_entities))])
        self.capacity = memory_bytes // _SORT_ROW_BYTES  # rows a bucket may hold to be sorted in RAM
        self.slice_rows = memory_bytes // _DISTRIBUTE_ROW_BYTES  # rows distributed at a time
        # two histograms of int64 bins within 1/16 of the budget
        self.bin_bits = max(4, min(_MAX_BIN_BITS, (memory_bytes // 256).bit_length() - 1))
        self.max_span = KEY_LIMIT // num_entities  # queries one sort key (q - q_lo) * E + a can hold
        self.tmp = Path(tempfile.mkdtemp(prefix=".sort-", dir=directory))
        self.serial = 0
        self.outputs: dict[str, dict[str, tuple[Path, object]]] = {}
        self.written = dict.fromkeys(SIDES, 0)

    # pass 1 and 2 over the caller's chunks -------------------------------------------------

    def build(self, chunks: Callable[[], Iterable[np.ndarray]]) -> None:
        root = _Range(0, self.E * self.R, 0, self.E)
        shift = root.shift(self.bin_bits)
        histograms = {side: np.zeros(((root.span - 1) >> shift) + 1, np.int64) for side in SIDES}
        total = 0
        for triples in self._slices(chunks()):
            total += len(triples)
            for side in SIDES:
                histograms[side] += np.bincount(
                    root.bins(self._side(triples, side), shift), minlength=len(histograms[side])
                )
        buckets = {side: self._plan(root, histograms[side], shift, total) for side in SIDES}
        del histograms
        for triples in self._slices(chunks()):
            for side in SIDES:
                self._distribute(self._side(triples, side), root, shift, buckets[side])
        for side in SIDES:
            self._check_counts(buckets[side], "chunks() yielded other triples on its second call than on its first")
        self._open_outputs(total)
        for side in SIDES:
            for bucket in buckets[side]:
                self._sort(side, bucket)
        self._commit()

    def _slices(self, chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """The triples of ``chunks``, validated, as int64 ``(k, 3)`` arrays of at most
        ``slice_rows`` rows (one buffer, reused: each is gone at the next)."""
        staged = np.empty((self.slice_rows, 3), np.int64)
        filled = 0
        for number, chunk in enumerate(chunks):
            chunk = np.asarray(chunk)
            self._validate(chunk, number)
            for start in range(0, len(chunk), self.slice_rows):
                piece = chunk[start : start + self.slice_rows]
                take = min(len(piece), self.slice_rows - filled)
                staged[filled : filled + take] = piece[:take]
                filled += take
                if filled == self.slice_rows:
                    yield staged
                    filled = len(piece) - take
                    staged[:filled] = piece[take:]
        if filled:
            yield staged[:filled]

    def _validate(self, chunk: np.ndarray, number: int) -> None:
        if chunk.ndim != 2 or chunk.shape[1] != 3 or not np.issubdtype(chunk.dtype, np.integer):
            raise DatasetError(
                f"chunk {number} of the triples is a {chunk.dtype} array of shape {chunk.shape}, not (k, 3) integer ids",
                hint="yield (head, relation, tail) id rows as int32 or int64 arrays of shape (k, 3)",
            )
        if not len(chunk):
            return
        for column, name, limit in ((0, "head", self.E), (1, "relation", self.R), (2, "tail", self.E)):
            low, high = int(chunk[:, column].min()), int(chunk[:, column].max())
            if low < 0 or high >= limit:
                bad = low if low < 0 else high
                raise DatasetError(
                    f"chunk {number} of the triples has {name} id {bad:,}, outside [0, {limit:,})",
                    hint=f"pass num_entities / num_relations that cover every id, or fix the {name} ids",
                )

    def _side(self, triples: np.ndarray, side: str) -> np.ndarray:
        """The (query, answer) records of one side of ``(k, 3)`` triples."""
        anchor, answer = (triples[:, 0], triples[:, 2]) if side == "tail" else (triples[:, 2], triples[:, 0])
        records = np.empty(len(triples), self.records)
        np.multiply(anchor, self.R, out=records["query"])
        records["query"] += triples[:, 1]
        records["answer"] = answer
        return records

    # buckets ---------------------------------------------------------------------------------

    def _plan(self, within: _Range, histogram: np.ndarray, shift: int, rows: int) -> list[_Bucket]:
        """Cut the non-empty bins greedily into buckets of at most ``target`` rows (a bin
        bigger than that is a bucket alone) whose query span a sort key can hold."""
        target = max(self.capacity, -(-rows // MAX_BUCKETS))
        span = 1 if within.by_answer else 1 << shift
        buckets: list[_Bucket] = []
        first = end = size = 0
        for b in np.flatnonzero(histogram).tolist():
            count = int(histogram[b])
            if size and (size + count > target or (b + 1 - first) * span > self.max_span):
                buckets.append(self._bucket(within.part(first, end, shift), size, first))
                size = 0
            if not size:
                first = b
            size, end = size + count, b + 1
        if size:
            buckets.append(self._bucket(within.part(first, end, shift), size, first))
        return buckets

    def _bucket(self, range_: _Range, rows: int, first_bin: int) -> _Bucket:
        self.serial += 1
        return _Bucket(range_, rows, self.tmp / f"{self.serial}.bucket", first_bin)

    def _distribute(self, records: np.ndarray, within: _Range, shift: int, buckets: list[_Bucket]) -> None:
        """Append each record to the file of the bucket its bin belongs to."""
        bins = within.bins(records, shift)
        which = np.searchsorted(np.array([b.first_bin for b in buckets], np.int64), bins, side="right") - 1
        del bins
        which = which.astype(np.uint16)  # at most 2^16 bins, so buckets: the stable sort is a radix sort
        order = np.argsort(which, kind="stable")
        counts = np.bincount(which, minlength=len(buckets))
        del which
        start = 0
        for bucket, count in zip(buckets, counts.tolist()):
            if count:
                fd = os.open(bucket.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    records[order[start : start + count]].tofile(f)
                start += count

    def _check_counts(self, buckets: list[_Bucket], problem: str) -> None:
        for bucket in buckets:
            try:
                size = os.lstat(bucket.path).st_size
            except FileNotFoundError:
                size = 0
            if size != bucket.rows * self.records.itemsize:
                raise DatasetError(
                    f"{problem}: {size // self.records.itemsize:,} rows fell into a range where the count found "
                    f"{bucket.rows:,}",
                    hint="make chunks() a function that yields the same triples, in any order, every time it is called",
                )

    def _read(self, path: Path, count: int | None = None) -> Iterator[np.ndarray]:
        with open(path, "rb") as f:
            while True:
                records = np.fromfile(f, self.records, count=count or -1)
                if not len(records):
                    return
                yield records
                if count is None:
                    return

    def _sort(self, side: str, bucket: _Bucket) -> None:
        """Append the bucket's distinct rows, sorted by (query, answer), to the side's columns."""
        range_ = bucket.range
        if range_.by_answer and range_.a_hi - range_.a_lo == 1:  # one triple, maybe many times
            bucket.path.unlink()
            self._append(side, np.array([range_.q_lo]), np.array([range_.a_lo]))
            return
        if bucket.rows > self.capacity or (range_.q_hi - range_.q_lo) > self.max_span:
            self._split(side, bucket)
            return
        (records,) = self._read(bucket.path)
        bucket.path.unlink()
        key = np.subtract(records["query"], range_.q_lo, dtype=np.int64)
        key *= self.E
        key += records["answer"]
        del records
        key.sort()
        keep = np.empty(len(key), bool)
        keep[:1] = True
        np.not_equal(key[1:], key[:-1], out=keep[1:])
        key = key[keep]
        del keep
        query, answer = np.divmod(key, self.E)
        del key
        query += range_.q_lo
        self._append(side, query, answer)

    def _split(self, side: str, bucket: _Bucket) -> None:
        """Distribute a bucket too big (or too wide) to sort in RAM over finer bins, then sort those."""
        within = bucket.range
        shift = within.shift(self.bin_bits)
        histogram = np.zeros(((within.span - 1) >> shift) + 1, np.int64)
        for records in self._read(bucket.path, self.slice_rows):
            histogram += np.bincount(within.bins(records, shift), minlength=len(histogram))
        parts = self._plan(within, histogram, shift, bucket.rows)
        del histogram
        for records in self._read(bucket.path, self.slice_rows):
            self._distribute(records, within, shift, parts)
        self._check_counts(parts, f"the temporary file '{bucket.path}' changed while it was sorted")
        bucket.path.unlink()
        for part in parts:
            self._sort(side, part)

    # the output columns ----------------------------------------------------------------------

    def _open_outputs(self, rows: int) -> None:
        """Create the four columns under temporary names, headers sized for ``rows`` rows."""
        dtypes = {"query": QUERY_DTYPE, "answer": self.records["answer"]}
        for side in SIDES:
            self.outputs[side] = {}
            for column in COLUMNS:
                path = self.directory / f".{FILES[side][column]}.tmp-{uuid.uuid4().hex[:12]}"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                f = os.fdopen(fd, "wb")
                self.outputs[side][column] = (path, f)
                f.write(npy_header(dtypes[column], (rows,)))

    def _append(self, side: str, query: np.ndarray, answer: np.ndarray) -> None:
        query.astype(QUERY_DTYPE, copy=False).tofile(self.outputs[side]["query"][1])
        answer.astype(self.records["answer"], copy=False).tofile(self.outputs[side]["answer"][1])
        self.written[side] += len(query)

    def _commit(self) -> None:
        """Final headers, fsync, rename over the old columns, then the manifest."""
        rows = self.written["tail"]
        assert self.written["head"] == rows, self.written  # the same distinct triples, seen from both ends
        dtypes = {"query": QUERY_DTYPE, "answer": self.records["answer"]}
        for side in SIDES:
            for column, (_, f) in self.outputs[side].items():
                f.flush()
                f.seek(0)  # the header reserved for every row read, rewritten for the distinct count
                f.write(npy_header(dtypes[column], (rows,)))  # fixed size: it fits the same bytes
                f.flush()
                os.fsync(f.fileno())
                f.close()
        try:
            os.unlink(self.directory / MANIFEST)  # no manifest describes a half-replaced folder
        except FileNotFoundError:
            pass
        for side in SIDES:
            for column, (path, _) in self.outputs[side].items():
                os.replace(path, self.directory / FILES[side][column])
        self.outputs = {}
        fsync_directory(self.directory)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "num_entities": self.E,
            "num_relations": self.R,
            "rows": rows,
            "query": "tail: head * num_relations + relation; head: tail * num_relations + relation",
            "dtypes": {"query": QUERY_DTYPE.str, "answer": self.records["answer"].str},
            "files": FILES,
        }
        atomic_write_bytes(self.directory / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())

    def discard(self) -> None:
        """Remove the temporary folder and any column not renamed into place."""
        for columns in self.outputs.values():
            for path, f in columns.values():
                f.close()
                path.unlink(missing_ok=True)
        self.outputs = {}
        shutil.rmtree(self.tmp, ignore_errors=True)
