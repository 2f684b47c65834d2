r"""An edge list (a file or a folder of files: text, see :mod:`.edge_list`, or parquet, see
:mod:`.edge_parquet`) and an optional labels file imported into the on-disk graph format
(:mod:`.graph_import`) in bounded memory.

**Node ids.** With ``ids: names`` (the default) a node's name is any text, and the nodes are
numbered by the streaming, fingerprinted import of the TSV knowledge graphs
(:mod:`.tsv_import`): each name's 128-bit fingerprint goes to a scratch partition with its
position, each partition is sorted alone, and a node's id is its rank in fingerprint order.
Row ``i`` is therefore not the ``i``-th name of the file; ``nodes.names`` /
``nodes.offsets`` hold the names in id order and ``nodes.fingerprints`` (sorted) looks a name
up (``export`` writes the names file, ``open_run(...).rows(...)`` maps names to rows). No
Python dict of the names is ever built. With ``ids: integers`` the ids are the numbers
written (``0 .. N-1``, ``N`` one past the largest), and the graph holds no names.

**What happens to the edges.** Every edge joins both of its ends (the graph is undirected),
unless ``directed: true``: then an edge ``u v`` is ``u -> v`` only, walks follow it from
``u`` and never back, and a node with no out-edge ends its walk there (it stays for the
walk's remaining steps, as PyG's ``Node2Vec`` through pyg-lib's ``random_walk`` does).
A self-loop ``(u, u)`` is dropped (its node keeps its id, and is isolated if it has no other
edge); an edge given twice, in either direction (directed: in the same direction), is kept
once; with ``min_weight``, an edge
whose weight is below it is dropped as if absent. The manifest's meta counts the edges read
(``input_edges``), the self-loops and the edges dropped by weight; ``num_edges`` counts the
distinct training edges left. Held-out edges for link prediction are chosen by the seeded
hash of :mod:`.graph_import`.

**Labels** (``dataset.labels``): ``node<TAB>label`` lines (runs of spaces and tabs also
separate, where the first line has no tab), an optional third column ``train``, ``valid`` or
``test`` naming the node's split, ``#`` comments, and an optional header (``node label
[split]``). Labels that are all whole numbers are the classes themselves; otherwise classes
are numbered in the sorted order of the labels (their names are in the meta,
``class_names``). A node labelled but in no edge is a node of the graph (isolated). Without
a split column, labelled nodes go to valid and test by a seeded hash (``node_split``) and the
rest train; unlabelled nodes are in no split (label -1).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np

from ..errors import DatasetError
from ..progress import work
from . import edge_parquet
from .edge_list import (
    WHITESPACE,
    EdgeFormat,
    edge_format,
    file_chunks,
    parse_floats,
    parse_integers,
    raise_line_problems,
    split_chunk,
)
from .fingerprint import fingerprints, hash_columns
from .graph_import import BLOCK_NODES, fraction_bound, write_csr, write_nodes
from .store import DatasetWriter
from .tsv import MAX_REPORTED
from .tsv_import import SequenceReader, _number, _Partitions, ordered_map, partitions_for

logger = logging.getLogger(__name__)

IMPORTER_VERSION = 1
WINDOW = 1 << 20  # positions assembled at once
MAX_CLASSES = 1 << 15
SPLIT_WORDS = {b"train": 0, b"valid": 1, b"test": 2}
LABEL_HEADER = {b"node", b"id", b"node_id", b"name"}


def edge_files(path: Path, looked: str | None = None) -> list[Path]:
    """The edge-list file, or a folder's files (sorted by name; hidden ones and those whose
    name starts with ``_``, such as Spark's ``_SUCCESS``, left out); a ``DatasetError`` says
    what is missing (``looked``: where the path was looked for)."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith((".", "_")))
        if not files:
            raise DatasetError(
                f"edge-list folder '{path}' holds no files",
                hint="place the edge-list files in it, or point dataset.path at a file",
            )
        return files
    raise DatasetError(
        f"edge list '{path}' does not exist" + (f": looked in {looked}" if looked else ""),
        hint="check dataset.path (a file of edges, or a folder of such files; a relative path is read from the current folder, else the data root)",
    )


def write_edge_list(
    writer: DatasetWriter,
    *,
    files: list[Path],
    labels: Path | None,
    config,
    link_split: tuple[float, float],
    seed: int,
    memory_bytes: int = 256 << 20,
) -> None:
    """Import ``files`` (and ``labels``) into ``writer`` as a graph (see the module docstring);
    ``config``: the recipe's ``dataset.edges``."""
    counts = {"input_edges": 0, "self_loops": 0, "below_min_weight": 0}
    total = sum(f.stat().st_size for f in files) + (labels.stat().st_size if labels else 0)
    if edge_parquet.is_parquet(files[0]):
        fmt = edge_parquet.parquet_format(files, config)
        text_bytes = 4 * fmt.rows + total  # what partitions_for expects: 2 bytes a name at least, 2 names a row
        chunks = partial(edge_parquet.parquet_chunks, files, fmt, config, counts, total)
    else:
        fmt = edge_format(
            files[0],
            delimiter=config.delimiter,
            comment=config.comment,
            header=config.header,
            source=config.source,
            target=config.target,
            weight=config.weight,
        )
        _same_format(files)
        text_bytes = total
        chunks = partial(_edge_chunks, files, fmt, config, counts, total)
    logger.info(f"edge list '{files[0] if len(files) == 1 else files[0].parent}': {fmt.describe()}")
    scratch = writer.path(".edges")
    scratch.mkdir()
    label_rows = _LabelRows(scratch) if labels is not None else None
    done = sum(f.stat().st_size for f in files)
    if config.ids == "names":
        num_nodes, edges, label_nodes = _named(
            writer, scratch, chunks, labels, label_rows, text_bytes, done, total, memory_bytes
        )
    else:
        num_nodes, edges, label_nodes = _numbered(scratch, chunks, labels, label_rows, done, total)
    try:
        write_csr(
            writer,
            _counting(edges, counts),
            num_nodes,
            edges_bound=max(1, counts["input_edges"]),
            link_split=link_split,
            seed=seed,
            memory_bytes=memory_bytes,
            what="writing the adjacency",
            directed=config.directed,
        )
        if label_rows is None:
            write_nodes(writer, num_nodes, None, [])
        else:
            _write_labels(writer, scratch, num_nodes, label_nodes, label_rows, config.node_split, seed)
    finally:
        if label_rows is not None:
            label_rows.close()
    shutil.rmtree(scratch)
    writer.meta.update(counts, names=config.ids == "names")


def _same_format(files: list[Path]) -> None:
    """A text edge list's files are all text (a parquet file among them is refused by name)."""
    for path in files[1:]:
        if edge_parquet.is_parquet(path):
            raise DatasetError(
                f"'{path}' is a parquet file, but '{files[0]}' is text", hint="keep one format in an edge-list folder"
            )


def _counting(edges: Iterator[tuple[np.ndarray, np.ndarray]], counts: dict) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for u, v in edges:
        counts["self_loops"] += int((u == v).sum())
        yield u, v


# -- reading -------------------------------------------------------------------------------------
def _edge_chunks(files: list[Path], fmt: EdgeFormat, config, counts: dict, total: int):
    """Every chunk's edges as ``(text, (n, 2, 2) source and target fields)`` (with ``ids:
    integers``: ``(text, (n, 2) ids)``), checked, edges below ``min_weight`` left out; bad
    lines raise a ``DatasetError`` listing up to :data:`MAX_REPORTED` of a file's."""

    def read(item):
        path, data, before, first = item
        text, fields, lines, found = split_chunk(data, fmt, fmt.columns, skip_header=fmt.header and first)
        problems = [f"{path}:{before + index + 1}: line {problem}" for index, problem in found]
        dropped = 0
        if not problems and config.weight is not None:
            weights, bad = parse_floats(text, fields[:, 2, 0], fields[:, 2, 1])
            problems = _bad_fields(path, before, text, lines, fields[:, 2], bad, "weight", "a number")
            keep = weights >= config.min_weight if config.min_weight is not None else np.ones(len(fields), bool)
            dropped = int((~keep).sum())
            fields, lines = fields[keep], lines[keep]
        fields = fields[:, :2]
        if not problems and config.ids == "integers":
            ids, bad = parse_integers(text, fields[..., 0].ravel(), fields[..., 1].ravel())
            bad = bad.reshape(-1, 2)
            problems = _bad_fields(
                path, before, text, np.repeat(lines, 2), fields.reshape(-1, 2), bad.ravel(), "node id", INTEGER_WORDS
            )
            fields = ids.reshape(-1, 2)
        return path, len(data), problems, text, fields, dropped

    done, problems, last = 0, [], None
    for path, size, found, text, fields, dropped in ordered_map(read, file_chunks(files)):
        if path != last and problems:
            raise_line_problems(last, problems, fmt)
        problems, last = problems + found, path
        if len(problems) > MAX_REPORTED:
            raise_line_problems(path, problems, fmt)
        if problems:
            continue
        counts["input_edges"] += len(fields)
        counts["below_min_weight"] += dropped
        done += size
        work("reading the edges", done, total)
        yield text, fields
    if problems:
        raise_line_problems(last, problems, fmt)


INTEGER_WORDS = (
    "a whole number 0 .. 10^18 (dataset.edges.ids is 'integers'; set it to 'names' to read any text as a node's name)"
)


def _bad_fields(
    path: Path,
    before: int,
    text: np.ndarray,
    lines: np.ndarray,
    fields: np.ndarray,
    bad: np.ndarray,
    what: str,
    expected: str,
) -> list[str]:
    """``path:line: ...`` for each field marked ``bad`` (``lines``: each field's line index in the chunk)."""
    return [
        f"{path}:{before + int(i) + 1}: line has {what} {bytes(text[s : s + n]).decode(errors='replace')!r}, not {expected}"
        for i, (s, n) in zip(lines[bad][: MAX_REPORTED + 1], fields[bad])
    ]


def _label_format(path: Path) -> tuple[EdgeFormat, bool]:
    """The labels file's format (tab-separated, else runs of whitespace; 2 or 3 columns) and
    whether its first line is a header."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    lines = [line for line in head.split(b"\n") if line.strip() and not line.startswith(b"#")]
    if not lines:
        raise DatasetError(
            f"labels file '{path}' has no lines", hint="write node<TAB>label lines, or leave dataset.labels out"
        )
    delimiter = "\t" if b"\t" in lines[0] else WHITESPACE
    first = lines[0].rstrip(b"\r").split(b"\t") if delimiter == "\t" else lines[0].split()
    if len(first) not in (2, 3):
        raise DatasetError(
            f"labels file '{path}' first line {lines[0][:200]!r} has {len(first)} columns",
            hint="write node<TAB>label lines, with an optional third column train, valid or test",
        )
    header = first[0].strip().lower() in LABEL_HEADER
    return EdgeFormat(delimiter, "#", header, len(first), tuple(range(len(first)))), header


def _label_chunks(path: Path, label_rows: _LabelRows, done: int, total: int, *, integers: bool):
    """The labels file's node fields, chunk by chunk, as ``(text, (n, 2) starts and lengths)``
    (``integers``: as ``(text, (n,) ids)``); each row's label and split go to ``label_rows``."""
    fmt, header = _label_format(path)

    def read(item):
        _, data, before, first = item
        text, fields, lines, found = split_chunk(data, fmt, fmt.columns, skip_header=header and first)
        problems = [f"{path}:{before + index + 1}: line {problem}" for index, problem in found]
        split = np.full(len(fields), -1, np.int8)
        if not problems and fmt.width == 3:
            words = fingerprints(text, fields[:, 2, 0], fields[:, 2, 1])[:, 0]
            for word, code in SPLIT_WORDS.items():
                split[
                    words == fingerprints(np.frombuffer(word, np.uint8), np.array([0]), np.array([len(word)]))[0, 0]
                ] = code
            problems = [
                f"{path}:{before + int(i) + 1}: line's split {bytes(text[s : s + n]).decode(errors='replace')!r} is not train, valid or test"
                for i, (s, n) in zip(lines[split < 0][: MAX_REPORTED + 1], fields[split < 0, 2])
            ]
        nodes = fields[:, 0]
        if not problems and integers:
            nodes, bad = parse_integers(text, fields[:, 0, 0], fields[:, 0, 1])
            problems = _bad_fields(path, before, text, lines, fields[:, 0], bad, "node id", INTEGER_WORDS)
        return len(data), problems, text, fields, split, nodes

    problems = []
    for size, found, text, fields, split, nodes in ordered_map(read, file_chunks([path])):
        problems += found
        if len(problems) > MAX_REPORTED:
            break
        if problems:
            continue
        label_rows.add(text, fields[:, 1], split)
        done += size
        work("reading the labels", done, total)
        yield text, nodes
    if problems:
        raise_line_problems(path, problems)


class _LabelRows:
    """The labels file's rows, in file order: each row's label (a key into the classes) and
    split (-1: none given), in scratch files; the distinct labels, in memory (they are few)."""

    def __init__(self, scratch: Path) -> None:
        self.keys_path, self.splits_path = scratch / "label-keys", scratch / "label-splits"
        self.keys, self.splits = open(self.keys_path, "wb"), open(self.splits_path, "wb")
        self.classes: dict[int, bytes] = {}
        self.rows = 0

    def add(self, text: np.ndarray, fields: np.ndarray, split: np.ndarray) -> None:
        keys = fingerprints(text, fields[:, 0], fields[:, 1])[:, 0]
        distinct, first = np.unique(keys, return_index=True)
        for key, row in zip(distinct.tolist(), first.tolist()):
            if key not in self.classes:
                start, length = fields[row]
                self.classes[key] = bytes(text[start : start + length])
        if len(self.classes) > MAX_CLASSES:
            raise DatasetError(
                f"the labels file has more than {MAX_CLASSES:,} distinct labels",
                hint="a label is a node's class; check that the second column is the label",
            )
        keys.tofile(self.keys)
        split.tofile(self.splits)
        self.rows += len(keys)

    def close(self) -> None:
        self.keys.close()
        self.splits.close()

    def class_table(self) -> tuple[np.ndarray, np.ndarray, int, list[str] | None]:
        """The label keys (sorted), each one's class, the number of classes, and the class
        names (``None`` where the labels are the class numbers themselves)."""
        self.close()
        names = {key: name.decode("utf-8") for key, name in self.classes.items()}
        keys = np.array(sorted(names), np.uint64)
        if all(n.isdigit() and len(n) < 10 for n in names.values()):
            classes = np.array([int(names[k]) for k in keys.tolist()], np.int64)
            return keys, classes, int(classes.max(initial=-1)) + 1, None
        ordered = sorted(names.values())
        rank = {name: i for i, name in enumerate(ordered)}
        return keys, np.array([rank[names[k]] for k in keys.tolist()], np.int64), len(ordered), ordered


# -- ids by name ---------------------------------------------------------------------------------
def _named(writer, scratch, chunks, labels, label_rows, text_bytes, done, total, memory_bytes):
    """Number the names (tsv_import's steps 1 and 2); returns the node count and generators of
    the edges' and the labelled rows' ids (step 3)."""
    parts = _Partitions(scratch / "nodes", partitions_for(text_bytes, memory_bytes), positions=False)
    position = 0

    def numbered(chunks):  # the tokens' positions are implicit: the order they are written in
        nonlocal position
        for text, fields in chunks:
            starts, lengths = fields[..., 0].ravel(), fields[..., 1].ravel()
            yield text, starts, lengths
            position += len(starts)

    def prepared(chunks):  # fingerprints and partitioning on the worker threads, in order
        return ordered_map(lambda item: parts.prepare(*item), numbered(chunks))

    try:
        for chunk in prepared(chunks()):
            parts.write(chunk)
        edge_positions = position
        if labels is not None:
            for chunk in prepared(
                ((t, f[:, None, :]) for t, f in _label_chunks(labels, label_rows, done, total, integers=False))
            ):
                parts.write(chunk)
    finally:
        parts.close()
    first_ids = _number(writer, "nodes", parts)
    reader = SequenceReader(parts, first_ids)

    def take(start: int, stop: int) -> np.ndarray:
        return reader.take(stop - start)

    def edges():
        for start in range(0, edge_positions, WINDOW):
            pairs = take(start, min(edge_positions, start + WINDOW)).reshape(-1, 2)
            yield pairs[:, 0], pairs[:, 1]

    def label_nodes():
        try:
            for start in range(edge_positions, position, WINDOW):
                yield take(start, min(position, start + WINDOW))
        finally:
            reader.close()

    return first_ids[-1], edges(), label_nodes()


# -- ids as numbers ------------------------------------------------------------------------------
def _numbered(scratch, chunks, labels, label_rows, done, total):
    """Read the ids as numbers into scratch files (the node count is known only at the end);
    returns it and generators of the edges and of the labelled rows' ids."""
    largest = -1
    edge_path, label_path = scratch / "pairs", scratch / "label-nodes"
    with open(edge_path, "wb") as out:
        for _, ids in chunks():
            largest = max(largest, ids.max(initial=-1))
            ids.tofile(out)
    if labels is not None:
        with open(label_path, "wb") as out:
            for _, ids in _label_chunks(labels, label_rows, done, total, integers=True):
                largest = max(largest, ids.max(initial=-1))
                ids.tofile(out)

    def blocks(path: Path, rows: int):
        with open(path, "rb") as f:
            while len(block := np.fromfile(f, np.int64, rows)):
                yield block

    def edges():
        for block in blocks(edge_path, 2 * WINDOW):
            pairs = block.reshape(-1, 2)
            yield pairs[:, 0], pairs[:, 1]

    return int(largest) + 1, edges(), (blocks(label_path, WINDOW) if labels is not None else iter(()))


# -- labels --------------------------------------------------------------------------------------
def _write_labels(writer, scratch, num_nodes, label_nodes, label_rows, node_split, seed) -> None:
    """Write each node's label and split (see the module docstring) through ``write_nodes``."""
    keys, classes, num_classes, class_names = label_rows.class_table()
    labels = np.lib.format.open_memmap(scratch / "labels.npy", "w+", np.int32, (max(1, num_nodes),))
    split = np.lib.format.open_memmap(scratch / "split.npy", "w+", np.int8, (max(1, num_nodes),))
    labels[:], split[:] = -1, -1
    valid_bound, test_bound = fraction_bound(node_split[0]), fraction_bound(node_split[0] + node_split[1])
    with open(label_rows.keys_path, "rb") as key_file, open(label_rows.splits_path, "rb") as split_file:
        row = 0
        for ids in label_nodes:
            key = np.fromfile(key_file, np.uint64, len(ids))
            given = np.fromfile(split_file, np.int8, len(ids))
            twice = np.flatnonzero((labels[ids] >= 0) | _repeated(ids))
            if len(twice):
                raise DatasetError(
                    f"the labels file's data line {row + int(twice[0]) + 1} labels a node that an earlier line labels already",
                    hint="give each node one label (one line per node)",
                )
            labels[ids] = classes[np.searchsorted(keys, key)]
            priority = hash_columns([ids], seed)
            drawn = np.where(priority < valid_bound, 1, np.where(priority < test_bound, 2, 0)).astype(np.int8)
            split[ids] = np.where(given >= 0, given, drawn)
            row += len(ids)

    def blocks():
        for low in range(0, num_nodes, BLOCK_NODES):
            high = min(num_nodes, low + BLOCK_NODES)
            yield np.arange(low, high), np.asarray(labels[low:high]), np.asarray(split[low:high])

    write_nodes(writer, num_nodes, max(num_classes, 1), blocks())
    if class_names is not None:
        writer.meta["class_names"] = class_names


def _repeated(ids: np.ndarray) -> np.ndarray:
    order = np.argsort(ids, kind="stable")
    again = np.zeros(len(ids), bool)
    again[order[1:]] = ids[order[1:]] == ids[order[:-1]]
    return again


def edge_sources(config) -> dict:
    """The ``dataset.edges`` settings as a manifest records them (JSON types)."""
    from dataclasses import asdict

    return json.loads(json.dumps(asdict(config)))
