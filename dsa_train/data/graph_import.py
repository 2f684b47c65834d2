r"""Writing a graph into the on-disk dataset format (:mod:`.store`, kind ``"graph"``) in
memory bounded by a budget, whatever the number of edges: :func:`write_csr` and
:func:`write_nodes`, which every graph's writer calls (the generator's in
:mod:`.graph_synthetic`, PyG's in :mod:`.graph_pyg`).

The folder holds (``E``: undirected training edges, ``N``: nodes; "id" is int32 where
``N < 2^31``, else int64)::

    rowptr.npy        (N + 1,) int64   node u's neighbours are col[rowptr[u] : rowptr[u + 1]]
    col.npy           (2E,) id         every training edge in both directions, each row sorted,
                                       no self-loops, no duplicates
    labels.npy        (N,) int8, int16 or int32 (the smallest that holds the classes)
    train_nodes.npy   ascending ids of the nodes a classifier may learn from
    valid_nodes.npy, test_nodes.npy    the same for the other splits (possibly empty)
    valid_edges.npy   (M, 2) id        held-out edges (u < v) for link prediction, ascending
    test_edges.npy    (M', 2) id
    manifest meta     num_nodes, num_edges, max_degree, num_classes

A directed graph (``directed=True``, ``meta["directed"]``) differs in three ways: ``col``
holds each edge ``u -> v`` once, in row ``u`` only (``E`` directed edges, a degree is an
out-degree); a held-out edge is ``(u, v)`` as given (not ``u < v``; ascending by ``u``);
its priority is :math:`h(u, v)`, so ``u -> v`` and ``v -> u`` are held out independently.

**The CSR, out of core.** Edges arrive in chunks of ``(u, v)`` pairs. Both directions of
each (self-loops dropped) go to scratch partition files by source node: partition
:math:`p` holds the sources :math:`[p s, (p + 1) s)` for a span :math:`s`, as the key
:math:`(u - p s) N + v` (int64: the span is chosen so that :math:`s N < 2^{63}`). The
partitions are contiguous ranges of :math:`u`, so once each is sorted and deduplicated
alone, appending them in order gives ``col`` in CSR order, and their per-source counts give
``rowptr``. A partition larger than the budget is split again by key range (which keeps the
order) until its pieces fit, or, where a piece's key range is narrow, deduplicated through a
bitmap of that range: memory stays within ``memory_bytes`` even when one node has most edges.

**Held-out edges** for link prediction are chosen by a seeded hash, edge by edge: the
undirected edge :math:`\{a, b\}` (:math:`a < b`) has priority :math:`h(a, b) \in [0, 2^{64})`;
it is a validation edge when :math:`h < f_v 2^{64}` and a test edge when
:math:`f_v 2^{64} \le h < (f_v + f_t) 2^{64}` (``link_split = (f_v, f_t)``). Both directions
of an edge have the same priority, so each is dropped from the CSR in its own partition, in
the same pass that writes it. Each edge is held out independently with probability
:math:`f_v` (or :math:`f_t`): the counts are binomial around :math:`f E`, and a held-out edge
is a held-out edge whatever the size of the rest of the graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from ..errors import DatasetError
from ..progress import work
from .fingerprint import hash_columns
from .store import MAX_PARTITIONS, DatasetWriter

IMPORTER_VERSION = 1
KEY_BYTES = 8
#: Bytes of RAM a key costs while its partition is sorted and deduplicated (counted: the key,
#: its source and target, the priority of held-out edges, their filtered copies and masks).
WORK_BYTES_PER_KEY = 64
BLOCK_NODES = 1 << 22  # rows of rowptr, labels or nodes handled at once


def id_dtype(num_nodes: int) -> np.dtype:
    """int32 where every node id fits, else int64."""
    return np.dtype(np.int32 if num_nodes < 2**31 else np.int64)


def label_dtype(num_classes: int) -> np.dtype:
    """The smallest signed integer type that holds ``0 .. num_classes - 1``."""
    for dtype in (np.int8, np.int16, np.int32):
        if num_classes - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def edge_priority(a: np.ndarray, b: np.ndarray, seed: int) -> np.ndarray:
    """The seeded 64-bit priority of the undirected edges ``{a, b}`` (symmetric in a and b)."""
    return hash_columns([np.minimum(a, b), np.maximum(a, b)], seed)


def fraction_bound(fraction: float) -> np.uint64:
    """``fraction * 2^64`` as a priority bound (a hash below it is held out)."""
    return np.uint64(min(int(fraction * 2**64), 2**64 - 1))


def write_csr(
    writer: DatasetWriter,
    chunks: Iterable[tuple[np.ndarray, np.ndarray]],
    num_nodes: int,
    *,
    edges_bound: int,
    link_split: tuple[float, float] = (0.0, 0.0),
    seed: int = 0,
    memory_bytes: int = 256 << 20,
    what: str = "reading edges",
    directed: bool = False,
) -> None:
    """Write ``rowptr``, ``col``, ``valid_edges`` and ``test_edges`` of the undirected graph
    whose edges ``chunks`` yields as ``(u, v)`` int64 arrays (either direction, repeats and
    self-loops allowed), holding out ``link_split`` of them (see the module docstring).
    ``directed``: each pair is the edge ``u -> v`` only (row ``u`` holds ``v``, not the
    reverse), and a held-out edge is ``(u, v)`` as given.

    ``edges_bound``: at most how many pairs ``chunks`` yields in all (sizes the partitions);
    ``memory_bytes``: the RAM the sort may use."""
    n = num_nodes
    budget_keys = max(1, memory_bytes // WORK_BYTES_PER_KEY)
    span = _span(n, (1 if directed else 2) * edges_bound, budget_keys)
    count = -(-n // span)
    scratch = writer.path(".scratch")
    scratch.mkdir()
    files = [scratch / f"part-{p}" for p in range(count)]
    parts = [open(path, "wb") for path in files]
    try:
        done = 0
        for u, v in chunks:
            _scatter(np.asarray(u, np.int64), np.asarray(v, np.int64), parts, n, span, directed)
            done += len(u)
            work(what, done, edges_bound)
    finally:
        for f in parts:
            f.close()
    ids = id_dtype(n)
    rowptr = writer.create("rowptr", (n + 1,), np.int64)
    col = writer.appender("col", ids)
    held = {"valid": writer.appender("valid_edges", ids, (2,)), "test": writer.appender("test_edges", ids, (2,))}
    valid_bound, test_bound = fraction_bound(link_split[0]), fraction_bound(link_split[0] + link_split[1])
    holding = link_split[0] > 0 or link_split[1] > 0
    total, max_degree = 0, 0
    for p, path in enumerate(files):
        low, high = p * span, min(n, (p + 1) * span)
        for keys in _sorted_unique(path, 0, (high - low) * n, budget_keys, scratch / f"part-{p}"):
            source, target = keys // n + low, keys % n
            if holding:
                priority = hash_columns([source, target], seed) if directed else edge_priority(source, target, seed)
                upper = (
                    np.ones(len(source), bool) if directed else source < target
                )  # an undirected edge is written once, as u < v
                valid, test = priority < valid_bound, (priority >= valid_bound) & (priority < test_bound)
                for name, chosen in (("valid", valid), ("test", test)):
                    chosen &= upper
                    held[name].append(np.stack([source[chosen], target[chosen]], 1))
                keep = priority >= test_bound
                source, target = source[keep], target[keep]
            col.append(target)
            first = np.flatnonzero(np.diff(source, prepend=-1))  # each source's first entry
            rowptr[source[first] + 1] += np.diff(np.append(first, len(source)))
        offset = total
        for start in range(low + 1, high + 1, BLOCK_NODES):  # degrees -> row pointers
            degrees = np.array(rowptr[start : min(high + 1, start + BLOCK_NODES)])  # a copy: rewritten below
            if len(degrees):
                max_degree = max(max_degree, int(degrees.max()))
            rowptr[start : start + len(degrees)] = offset + np.cumsum(degrees)
            offset += int(degrees.sum())
        total = offset
        work("sorting edges", p + 1, count)
    scratch.rmdir()
    rowptr.flush()
    writer.meta.update(num_nodes=n, num_edges=total if directed else total // 2, max_degree=max_degree)
    if directed:
        writer.meta["directed"] = True


def _span(n: int, keys: int, budget_keys: int) -> int:
    """Source nodes per partition: few enough partitions to keep open, enough for the budget,
    and ``span * n < 2^63`` so a key never overflows."""
    wanted = min(MAX_PARTITIONS, max(1, -(-keys // budget_keys)))
    span = -(-n // wanted)
    widest = (2**63 - 1) // max(n, 1)
    if span > widest:
        if -(-n // widest) > MAX_PARTITIONS:
            raise DatasetError(
                f"a graph of {n:,} nodes needs more than {MAX_PARTITIONS} partitions to keep its edge keys within int64",
                hint="lower the number of nodes (below about 4.9e10)",
            )
        span = widest
    return max(1, span)


def _scatter(u: np.ndarray, v: np.ndarray, parts: list, n: int, span: int, directed: bool = False) -> None:
    """Append both directions of the pairs (``directed``: ``u -> v`` only; self-loops
    dropped) to their sources' partitions."""
    keep = u != v
    u, v = u[keep], v[keep]
    source, target = (u, v) if directed else (np.concatenate([u, v]), np.concatenate([v, u]))
    partition = source // span
    order = np.argsort(partition.astype(np.uint16), kind="stable")  # a radix sort: fast
    keys = ((source - partition * span) * n + target)[order]
    bounds = np.searchsorted(partition[order], np.arange(len(parts) + 1))
    for p in np.flatnonzero(np.diff(bounds)).tolist():
        parts[p].write(keys[bounds[p] : bounds[p + 1]].tobytes())


def _sorted_unique(path: Path, low: int, high: int, budget_keys: int, stem: Path) -> Iterator[np.ndarray]:
    """The distinct keys of the file (all in ``[low, high)``), ascending, in blocks of at most
    ``budget_keys``; the file is removed. See the module docstring for the splits."""
    keys_in_file = path.stat().st_size // KEY_BYTES
    if keys_in_file <= budget_keys:
        keys = np.fromfile(path, np.int64)
        path.unlink()
        keys.sort()
        if len(keys):
            yield keys[np.diff(keys, prepend=keys[0] - 1) != 0]
        return
    if high - low <= budget_keys * WORK_BYTES_PER_KEY // 2:  # a narrow range: a bitmap of it
        present = np.zeros(high - low, bool)
        for block in _blocks(path, budget_keys):
            present[block - low] = True
        path.unlink()
        found = np.flatnonzero(present)
        del present
        for start in range(0, len(found), budget_keys):
            yield found[start : start + budget_keys] + low
        return
    pieces = min(MAX_PARTITIONS, 2 * -(-keys_in_file // budget_keys))
    bounds = np.array([low + (high - low) * i // pieces for i in range(pieces + 1)], np.int64)
    names = [stem.with_name(f"{stem.name}.{i}") for i in range(pieces)]
    outs = [open(name, "wb") for name in names]
    try:
        for block in _blocks(path, budget_keys):
            piece = np.searchsorted(bounds, block, side="right") - 1
            order = np.argsort(piece.astype(np.uint16), kind="stable")
            block, at = block[order], np.searchsorted(piece[order], np.arange(pieces + 1))
            for i in np.flatnonzero(np.diff(at)).tolist():
                outs[i].write(block[at[i] : at[i + 1]].tobytes())
    finally:
        for f in outs:
            f.close()
    path.unlink()
    for i, name in enumerate(names):
        yield from _sorted_unique(name, int(bounds[i]), int(bounds[i + 1]), budget_keys, name)


def _blocks(path: Path, rows: int) -> Iterator[np.ndarray]:
    with open(path, "rb") as f:
        while len(block := np.fromfile(f, np.int64, count=rows)):
            yield block


def write_nodes(
    writer: DatasetWriter,
    num_nodes: int,
    num_classes: int | None,
    blocks: Iterable[tuple[np.ndarray, np.ndarray | None, np.ndarray]],
) -> None:
    """Write ``labels`` (when ``num_classes`` is given) and the three node lists from
    ``blocks`` of ``(node ids ascending, their labels, their split: 0 train, 1 valid, 2 test,
    -1 none)``, in node order."""
    ids = id_dtype(num_nodes)
    labels = writer.appender("labels", label_dtype(num_classes)) if num_classes is not None else None
    lists = [writer.appender(f"{split}_nodes", ids) for split in ("train", "valid", "test")]
    for nodes, label, split in blocks:
        if labels is not None:
            labels.append(label)
        for which, target in enumerate(lists):
            target.append(nodes[split == which])
    writer.meta.update(num_classes=num_classes or 0)
