"""A TSV knowledge graph (see :mod:`.tsv`) imported into the on-disk dataset format (see
:mod:`.store`) in bounded memory.

The import streams the text in chunks and never holds a name table in memory:

1. **Read.** Each chunk is checked and split into columns by NumPy (positions of tabs and
   newlines), and every name gets a 128-bit fingerprint (:mod:`.fingerprint`). Entity tokens
   go to one of ``P`` partition files by their fingerprint's top bits, as
   ``(fingerprint, position)`` records; each chunk's distinct names go there too, with their
   bytes. Relations use one partition.
2. **Number.** Partition by partition (each fits the memory budget), the distinct
   fingerprints are sorted: an entity's id is its rank in fingerprint order, so
   ``entities.fingerprints.npy`` (sorted) is also the on-disk name -> id lookup, and the
   names are written in id order (``entities.names`` bytes, ``entities.offsets``). Each
   token record gets its id.
3. **Assemble.** The per-partition ``(position, id)`` streams, each in position order, are
   merged window by window into the ``(M, 3)`` id arrays of the splits (int32 where the ids
   fit), written sequentially.

RAM holds one chunk, one partition or one window at a time, whatever the size of the files;
scratch files (about 40 bytes per triple) live in the partial dataset folder and go before
it is committed.
"""

from __future__ import annotations

import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

from ..progress import work
from .fingerprint import fingerprints
from .store import SPLITS, DatasetWriter, partition_count
from .tsv import MAX_REPORTED, all_chunks, parse_chunk, raise_problems

IMPORTER_VERSION = 1
WINDOW_ROWS = 1 << 20  # triples assembled at once in step 3
TOKEN_BLOCK = 1 << 20  # tokens numbered at once in step 2
WORKERS = min(4, os.cpu_count() or 1)  # threads that parse chunks and number partitions
#: A distinct name of a chunk, where tokens have no positions: its token's index in the
#: partition's token file (which holds its fingerprint), and its length in bytes.
NAME_RECORD = np.dtype([("index", "<u8"), ("length", "<u4")])


class _Partitions:
    """Scratch files of one name space: token records and distinct names, per partition.

    ``positions=False`` (a name space whose tokens are numbered ``0, 1, 2, ...`` in the order
    they are written, as the edge import's are): a token record is ``(h1, h2)`` only, a
    ``sequence`` file holds each token's partition (one byte) in position order, and step 2
    writes each token's rank alone (uint32); :class:`SequenceReader` puts the ids back in
    position order. That is 21 bytes of scratch per token written and read back instead of
    40 (step 1's 24-byte records, step 2's 16-byte pairs). A distinct name's record is then
    its token's index in the partition's token file and its length (:data:`NAME_RECORD`,
    12 bytes instead of 24): step 2 reads its fingerprint from the token."""

    def __init__(self, folder: Path, count: int, *, positions: bool = True) -> None:
        self.folder, self.count, self.positions = folder, count, positions
        self.bits = count.bit_length() - 1
        # the smallest h1 of each partition (its top bits), and an end: h1 order is partition order
        self.first_keys = np.array(
            [p << (64 - self.bits) if self.bits else 0 for p in range(count)] + [2**64 - 1], np.uint64
        )
        folder.mkdir()
        self.tokens = [open(folder / f"tokens-{p}", "wb") for p in range(count)]
        self.names = [open(folder / f"names-{p}", "wb") for p in range(count)]
        self.blobs = [open(folder / f"blob-{p}", "wb") for p in range(count)]
        self.sequence = None if positions else open(folder / "sequence", "wb")
        self.written = [0] * count  # tokens in each token file so far

    def prepare(
        self, text: np.ndarray, starts: np.ndarray, lengths: np.ndarray, positions: np.ndarray | None = None
    ) -> tuple[list[tuple[int, bytes, bytes, bytes]], bytes]:
        """A chunk's tokens as ``(partition, token records, name records, name bytes)``:
        token records ``(h1, h2, position)`` (``(h1, h2)`` without positions) in position
        order, and the chunk's distinct names ``(h1, h2, length)`` with their bytes; and,
        without positions, the tokens' partitions (one byte each) in position order."""
        prints = fingerprints(text, starts, lengths)
        if self.positions:
            tokens = np.empty((len(starts), 3), np.uint64)
            tokens[:, :2], tokens[:, 2] = prints, positions
        else:
            tokens = prints
        partition = (
            (prints[:, 0] >> np.uint64(64 - self.bits)).astype(np.uint16)
            if self.bits
            else np.zeros(len(starts), np.uint16)
        )
        order = np.argsort(partition, kind="stable")  # a radix sort: cheap, and positions stay in order
        token_bounds = np.searchsorted(partition[order], np.arange(self.count + 1))
        tokens = np.take(tokens, order, axis=0)  # a gather of rows: several times faster than tokens[order]
        distinct = _distinct(prints)  # in h1 order, which is partition order
        names = np.empty((len(distinct), 3), np.uint64)
        names[:, :2], names[:, 2] = np.take(prints, distinct, axis=0), lengths[distinct]
        name_bounds = np.searchsorted(names[:, 0], self.first_keys)
        ends = np.concatenate([[0], np.cumsum(lengths[distinct])])
        blob = text[_ranges(starts[distinct], lengths[distinct])]
        if not self.positions:  # each distinct name's token: its place among its partition's tokens of the chunk
            place = np.empty(len(order), np.int64)
            place[order] = np.arange(len(order))
            place = place[distinct] - token_bounds[partition[distinct]]
        out = []
        for p in np.flatnonzero(np.diff(token_bounds)).tolist():
            lo, hi = name_bounds[p], name_bounds[p + 1]
            tokens_p = tokens[token_bounds[p] : token_bounds[p + 1]].tobytes()
            names_p = names[lo:hi].tobytes() if self.positions else (place[lo:hi], names[lo:hi, 2])
            out.append((p, tokens_p, names_p, blob[ends[lo] : ends[hi]].tobytes()))
        return out, (b"" if self.positions else partition.astype(np.uint8).tobytes())

    def write(self, prepared: tuple[list[tuple[int, bytes, bytes, bytes]], bytes]) -> None:
        out, sequence = prepared
        for p, tokens, names, blob in out:
            if not self.positions:  # the name's token index in the whole token file, known only here, in order
                place, length = names
                records = np.empty(len(place), NAME_RECORD)
                records["index"], records["length"] = place + self.written[p], length
                names = records.tobytes()
                self.written[p] += len(tokens) // 16
            self.tokens[p].write(tokens)
            self.names[p].write(names)
            self.blobs[p].write(blob)
        if self.sequence is not None:
            self.sequence.write(sequence)

    def close(self) -> None:
        for f in self.tokens + self.names + self.blobs + ([self.sequence] if self.sequence is not None else []):
            f.close()


def _distinct(prints: np.ndarray) -> np.ndarray:
    """Indices of one row per distinct fingerprint, in fingerprint order (a clash of h1 keeps
    every distinct h2)."""
    h1 = prints[:, 0]
    sample = h1[:: max(1, len(h1) // 4096)]
    few = len(np.unique(sample)) * 8 < len(sample)  # few names repeated a lot (relations, say)
    if not few:  # one sort of (h1's top bits | row): faster than an argsort of h1
        low = np.uint64(max(1, len(h1).bit_length()))
        key = ((h1 >> low) << low) | np.arange(len(h1), dtype=np.uint64)
        key.sort()
        rows = (key & ((np.uint64(1) << low) - np.uint64(1))).astype(np.int64)
        top = key >> low
        same = top[1:] == top[:-1]
        a, b = h1[rows], prints[:, 1][rows]
        if not (
            same & ((a[1:] != a[:-1]) | (b[1:] != b[:-1]))
        ).any():  # each run of equal top bits is one name: in h1 order
            return rows[np.concatenate([[True], ~same])]
        # else two names share h1's top bits (a few chunks in a hundred): the exact way below
    if few:
        values = np.unique(h1)
        group = np.searchsorted(values, h1)
        first = np.empty(len(values), np.int64)
        first[group[::-1]] = np.arange(len(h1) - 1, -1, -1)  # the first row of each value
        clashing = np.flatnonzero(prints[first[group], 1] != prints[:, 1])
    else:
        order = np.argsort(h1)
        ordered = h1[order]
        new = np.ones(len(order), bool)
        new[1:] = ordered[1:] != ordered[:-1]
        first = order[new]
        group = np.cumsum(new) - 1  # in sorted order
        clashing = order[prints[first[group], 1] != prints[order, 1]]
    if not len(clashing):
        return first
    rows = np.union1d(first, clashing)
    rows = rows[np.lexsort((prints[rows, 1], prints[rows, 0]))]
    keep = np.ones(len(rows), bool)
    keep[1:] = (prints[rows[1:]] != prints[rows[:-1]]).any(1)
    return rows[keep]


def ordered_map(function, items, workers: int = WORKERS):
    """``map(function, items)`` on a few threads (NumPy releases the GIL in its loops), in
    order, with at most ``workers + 1`` results waiting: memory stays bounded."""
    if workers <= 1:
        yield from map(function, items)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices of the concatenated ranges ``[starts[i], starts[i] + lengths[i])`` (lengths
    positive: names are never empty): a running sum of ones that jumps to each range's start."""
    lengths = lengths.astype(np.int64)
    steps = np.ones(int(lengths.sum()), np.int32 if len(lengths) and starts.max() + lengths.sum() < 2**31 else np.int64)
    if len(steps):
        steps[0] = starts[0]
        steps[np.cumsum(lengths)[:-1]] = starts[1:] - (starts[:-1] + lengths[:-1]) + 1
    return np.cumsum(steps)


def partitions_for(total_bytes: int, memory_bytes: int) -> int:
    """Entity partitions for ``total_bytes`` of text: a token costs at most ~60 bytes in step 2
    and takes at least 2 bytes of text."""
    return partition_count(-(-total_bytes // 2) * 60, memory_bytes)


def write_knowledge_graph(
    writer: DatasetWriter,
    *,
    files: list[Path],
    memory_bytes: int = 256 << 20,
    final_newline: bool = False,
    delimiter: str = "\t",
    header: bool = False,
) -> None:
    """Import the split files (train, valid, test) into ``writer`` (see the module docstring);
    ``delimiter`` between the columns, ``header``: each file's first line names them."""
    scratch = writer.path(".scratch")
    scratch.mkdir()
    total = sum(f.stat().st_size for f in files)
    spaces = {
        "entities": _Partitions(scratch / "entities", partitions_for(total, memory_bytes)),
        "relations": _Partitions(scratch / "relations", 1),
    }

    def read(item):
        path, data, before, row = item
        text, columns, found = parse_chunk(data, final_newline=final_newline, delimiter=delimiter)
        if found:
            return path, len(data), [f"{path}:{before + index + 1}: line {problem}" for index, problem in found], 0, []
        rows = np.arange(len(columns), dtype=np.int64) + row
        ends = columns[:, [0, 2]]
        entity_positions = (rows[:, None] * 3 + np.array([0, 2])).ravel()
        prepared = [
            spaces["entities"].prepare(text, ends[..., 0].ravel(), ends[..., 1].ravel(), entity_positions),
            spaces["relations"].prepare(text, columns[:, 1, 0], columns[:, 1, 1], rows * 3 + 1),
        ]
        return path, len(data), [], len(columns), prepared

    split_rows = {path: 0 for path in files}
    problems: dict[Path, list[str]] = {}
    done = 0
    try:
        for path, size, found, rows, prepared in ordered_map(read, all_chunks(files, header=header)):
            problems.setdefault(path, []).extend(found)
            if len(problems[path]) > MAX_REPORTED:
                break
            if not found:
                for space, chunk in zip(spaces.values(), prepared):
                    space.write(chunk)
            split_rows[path] += rows
            done += size
            work("reading the text", done, total)
    finally:
        for space in spaces.values():
            space.close()
    for path, found in problems.items():
        if found:
            raise_problems(path, found, delimiter)
    split_rows = [split_rows[path] for path in files]
    first_ids = {space: _number(writer, space, parts) for space, parts in spaces.items()}
    counts = {space: first[-1] for space, first in first_ids.items()}
    dtype = np.int32 if max(counts.values()) < 2**31 else np.int64
    _assemble(writer, [(spaces[space], first_ids[space]) for space in spaces], split_rows, dtype)
    shutil.rmtree(scratch)
    writer.meta.update(
        num_entities=counts["entities"],
        num_relations=counts["relations"],
        splits={split: rows for split, rows in zip(SPLITS, split_rows)},
        names=True,
    )


def _number(writer: DatasetWriter, space: str, parts: _Partitions) -> list[int]:
    """Step 2 for one name space: ids in fingerprint order, names in id order, and each
    partition's ``(position, rank)`` records (in position order) for step 3. Returns where each
    partition's ids start, and (last) how many names there are."""
    prints = writer.appender(f"{space}.fingerprints", np.uint64, (2,))
    names = writer.appender(f"{space}.names", np.uint8)
    offsets = writer.appender(f"{space}.offsets", np.int64)
    offsets.append(np.zeros(1, np.int64))
    first_ids, name_bytes = [0], 0
    for p, (unique, blob, lengths) in enumerate(ordered_map(partial(_number_partition, parts), range(parts.count))):
        prints.append(unique)
        names.append(blob)
        offsets.append(name_bytes + np.cumsum(lengths))
        name_bytes += int(lengths.sum())
        first_ids.append(first_ids[-1] + len(unique))
        work(f"numbering {space}", p + 1, parts.count)
    return first_ids


def _number_partition(parts: _Partitions, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One partition's distinct fingerprints (sorted), their names' bytes and lengths; its
    tokens' ``(position, rank)`` pairs go to ``ids-<p>``, a block of tokens at a time (a hot
    name makes a partition's tokens many, never its distinct names); its other scratch files
    are removed (runs in a worker thread)."""
    if parts.positions:
        records = np.fromfile(parts.folder / f"names-{p}", np.uint64).reshape(-1, 3)
    else:  # the fingerprints from the names' tokens
        found = np.fromfile(parts.folder / f"names-{p}", NAME_RECORD)
        records = np.empty((len(found), 3), np.uint64)
        if len(found):
            token_file = np.memmap(parts.folder / f"tokens-{p}", np.uint64, "r").reshape(-1, 2)
            records[:, :2] = np.take(token_file, found["index"], axis=0)
            del token_file
        records[:, 2] = found["length"]
        del found
    blob = np.fromfile(parts.folder / f"blob-{p}", np.uint8)
    byte_starts = np.concatenate([[0], np.cumsum(records[:, 2])[:-1]]).astype(np.int64)
    order = np.argsort(records[:, 0])
    h1, h2 = records[order, 0], records[order, 1]
    if ((h1[1:] == h1[:-1]) & (h2[1:] != h2[:-1])).any():  # two names share h1 (2^-64): order by h2 too
        order = np.lexsort((records[:, 1], records[:, 0]))
        h1, h2 = records[order, 0], records[order, 1]
    keep = np.ones(len(order), bool)
    keep[1:] = (h1[1:] != h1[:-1]) | (h2[1:] != h2[:-1])
    unique, lengths = np.stack([h1[keep], h2[keep]], 1), records[order[keep], 2].astype(np.int64)
    names = blob[_ranges(byte_starts[order[keep]], lengths)]
    del records, blob
    width = 3 if parts.positions else 2
    if len(unique) >= 2**32 and not parts.positions:
        raise ValueError(f"scratch partition {p} holds {len(unique):,} names, more than its uint32 ranks hold")
    with open(parts.folder / f"tokens-{p}", "rb") as source, open(parts.folder / f"ids-{p}", "wb") as target:
        while len(tokens := np.fromfile(source, np.uint64, width * TOKEN_BLOCK).reshape(-1, width)):
            rank = _rank(unique[:, 0], tokens[:, 0])
            while True:  # several names share this h1 (a 2^-64 event): step to the matching h2
                off = unique[np.minimum(rank, len(unique) - 1), 1] != tokens[:, 1]
                if not off.any():
                    break
                rank[off] += 1
            if not parts.positions:
                rank.astype(np.uint32).tofile(target)
                continue
            pairs = np.empty((len(tokens), 2), np.int64)
            pairs[:, 0], pairs[:, 1] = tokens[:, 2], rank
            pairs.tofile(target)
    for name in ("names", "blob", "tokens"):
        (parts.folder / f"{name}-{p}").unlink()
    return unique, names, lengths


def _rank(values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``np.searchsorted(values, keys)`` for sorted, uniformly spread uint64 ``values`` and keys
    that are among them: a table of where each bucket of the values' range starts, then a step
    or two forward (about twice as fast as a binary search per key, which misses the cache).
    The buckets split ``[values[0], values[-1]]``, not all of uint64: a partition's values
    share their top bits."""
    if not len(values):
        return np.zeros(len(keys), np.int64)
    bits = max(1, len(values).bit_length())
    low = values[0]
    shift = np.uint64(max(0, int(values[-1] - low).bit_length() - bits))
    starts = np.searchsorted(values, low + (np.arange(1 << bits, dtype=np.uint64) << shift))
    rank = starts[((keys - low) >> shift).astype(np.int64)]
    behind = np.flatnonzero(values[np.minimum(rank, len(values) - 1)] < keys)
    while len(behind):
        rank[behind] += 1
        behind = behind[values[np.minimum(rank[behind], len(values) - 1)] < keys[behind]]
    return rank


def _assemble(writer: DatasetWriter, spaces: list, split_rows: list[int], dtype) -> None:
    """Step 3: merge every partition's position-ordered ``(position, rank)`` stream into the
    splits' id arrays, one window of rows at a time (``spaces``: each name space's partitions
    and where each partition's ids start)."""
    streams = [_Stream(space.folder / f"ids-{p}", first[p]) for space, first in spaces for p in range(space.count)]
    total, row = sum(split_rows), 0
    try:
        for split, rows in zip(SPLITS, split_rows):
            out = writer.appender(split, dtype, (3,))
            end = row + rows
            while row < end:
                stop = min(row + WINDOW_ROWS, end)
                window = np.empty((stop - row) * 3, dtype)
                for stream in streams:
                    part = stream.take(stop * 3)
                    window[part[:, 0] - row * 3] = part[:, 1]
                out.append(window.reshape(-1, 3))
                row = stop
                work("writing the id arrays", row, total)
    finally:
        for stream in streams:
            stream.file.close()


class SequenceReader:
    """The ids of a name space written without positions (see :class:`_Partitions`), in
    position order, a window at a time: each window's partitions come from the ``sequence``
    file, and each partition's ranks, in order, from its ``ids-<p>`` file."""

    def __init__(self, parts: _Partitions, first_ids: list[int]) -> None:
        self.sequence = open(parts.folder / "sequence", "rb")
        self.ids = [open(parts.folder / f"ids-{p}", "rb") for p in range(parts.count)]
        self.first_ids = np.asarray(first_ids[:-1], np.int64)

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` tokens' ids (int64)."""
        partition = np.fromfile(self.sequence, np.uint8, count)
        order = np.argsort(partition, kind="stable")  # a radix sort: each partition's tokens, in position order
        counts = np.bincount(partition, minlength=len(self.ids))
        ranks = [np.fromfile(self.ids[p], np.uint32, int(counts[p])) for p in np.flatnonzero(counts).tolist()]
        window = np.empty(len(partition), np.int64)
        window[order] = np.concatenate(ranks) + np.repeat(self.first_ids, counts) if ranks else np.empty(0, np.int64)
        return window

    def close(self) -> None:
        for f in [self.sequence, *self.ids]:
            f.close()


class _Stream:
    """A file of ``(position, id)`` int64 pairs in position order, read a block at a time."""

    BLOCK = 1 << 14

    def __init__(self, path: Path, first_id: int) -> None:
        self.file, self.first_id = open(path, "rb"), first_id
        self.buffer = np.empty((0, 2), np.int64)

    def take(self, limit: int) -> np.ndarray:
        """The next pairs whose position is below ``limit``."""
        while not len(self.buffer) or self.buffer[-1, 0] < limit:
            block = np.fromfile(self.file, np.int64, 2 * self.BLOCK).reshape(-1, 2)
            if not len(block):
                break
            self.buffer = np.concatenate([self.buffer, block])
        cut = int(np.searchsorted(self.buffer[:, 0], limit))
        taken, self.buffer = self.buffer[:cut].copy(), self.buffer[cut:]
        taken[:, 1] += self.first_id
        return taken
