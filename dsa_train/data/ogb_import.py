"""OGB's ``ogbl-wikikg2`` and ``ogbl-biokg`` imported into the on-disk dataset format (:mod:`.store`).

The files (taken out of OGB's zip by :mod:`.remote`) are the node counts (``num-node-list.csv.gz``,
one number; biokg's ``num-node-dict.csv.gz``, a header of entity types over their counts) and the
split's ``{train,valid,test}.pt`` (read by :mod:`.ogb_split`, never unpickled beyond NumPy arrays).

**Ids.** wikikg2's ids are global already. biokg's are local to an entity type: ``head`` is the
row of ``head_type``'s entities, and so are the ``head_neg`` of that triple (the negatives of a
query are entities of the answer's type). As OGB's example code does (``entity_dict``), the global
id is the local id plus the type's offset, the types laid out one after another in sorted order of
their names (``read_csv_heterograph_raw``'s ``num_nodes_dict``), so entity ``i`` here is entity
``i`` of OGB's examples. The relation count is one past the largest relation id of any split.

**Arrays.** ``train``, ``valid``, ``test`` ``(M, 3)`` (int32 while ids fit), and per held-out
split ``<split>.head_neg`` and ``<split>.tail_neg``, ``(M, K)`` global ids in the same dtype,
mapped read-only by evaluation a batch at a time (:meth:`~.kg.KnowledgeGraph.fixed_negatives`).
Every id is checked against its type's count before it is written. Each split is written in
blocks of :data:`BLOCK` rows; the split file itself is read whole (see :mod:`.ogb_split`).
"""

from __future__ import annotations

import csv
import gzip
import io
from pathlib import Path

import numpy as np

from ..errors import DatasetError
from ..progress import work
from .ogb_split import load_split
from .store import SPLITS, DatasetWriter

IMPORTER_VERSION = 1
BLOCK = 1 << 20  # rows converted and written at once

#: dataset -> (node counts file, typed ids)
DATASETS = {"ogbl-wikikg2": ("num-node-list.csv.gz", False), "ogbl-biokg": ("num-node-dict.csv.gz", True)}


def ogb_files(name: str, folder: Path) -> list[Path]:
    """The files of the dataset's folder the import reads (the sources of the import)."""
    return [folder / DATASETS[name][0]] + [folder / f"{split}.pt" for split in SPLITS]


def entity_types(name: str, folder: Path) -> dict[str, tuple[int, int]]:
    """Each entity type's ``(offset, count)`` in the global ids (``{"": (0, N)}`` untyped)."""
    counts_file, typed = DATASETS[name]
    path = folder / counts_file
    try:
        with gzip.open(path, "rt", newline="") as f:
            rows = [row for row in csv.reader(io.StringIO(f.read(1 << 20))) if row]
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read '{path}': {e}", hint=_fresh(path)) from None
    try:
        if typed:  # a header of type names over one row of counts
            counts = dict(zip(rows[0], (int(c) for c in rows[1]), strict=True))
        else:
            counts = {"": int(rows[0][0])}
    except (IndexError, ValueError) as e:
        raise DatasetError(f"'{path}' does not hold OGB's node counts ({e})", hint=_fresh(path)) from None
    types, offset = {}, 0
    for t in sorted(counts):  # OGB's order: the sorted type names
        types[t] = (offset, counts[t])
        offset += counts[t]
    return types


def write_ogbl(writer: DatasetWriter, *, name: str, folder: Path) -> None:
    """Import ``name`` from its folder: the splits' triples and fixed negatives, global ids."""
    typed = DATASETS[name][1]
    types = entity_types(name, folder)
    num_entities = sum(count for _, count in types.values())
    dtype = np.int32 if num_entities < 2**31 else np.int64
    max_relation, negatives = -1, {}
    for split in SPLITS:
        path = folder / f"{split}.pt"
        work(f"reading {name}'s {split} split", 0, 1)
        data = load_split(path, split=split, typed=typed)
        work(f"reading {name}'s {split} split", 1, 1)
        head_offset, tail_offset = _offsets(data, types, path) if typed else (None, None)
        out = writer.appender(split, dtype, (3,))
        m = len(data["head"])
        for start in range(0, m, BLOCK):
            rows = slice(start, min(start + BLOCK, m))
            block = np.empty((rows.stop - rows.start, 3), np.int64)
            block[:, 0] = _global(data, "head", rows, head_offset, types, path)
            block[:, 1] = data["relation"][rows]
            block[:, 2] = _global(data, "tail", rows, tail_offset, types, path)
            if len(block) and block[:, 1].min() < 0:
                raise DatasetError(f"'{path}' has a negative relation id", hint=_fresh(path))
            max_relation = max(max_relation, int(block[:, 1].max(initial=-1)))
            out.append(block)
        for side, offset in (("head", head_offset), ("tail", tail_offset)):
            if split == "train":
                continue
            key = f"{side}_neg"
            width = data[key].shape[1]
            target = writer.create(f"{split}.{key}", (m, width), dtype)
            for start in range(0, m, BLOCK):
                rows = slice(start, min(start + BLOCK, m))
                target[rows] = _global(data, key, rows, offset, types, path, answer=side)
            if m:
                target.flush()
            negatives[split] = width
        del data  # the next split is read only once this one is written
    writer.meta.update(
        num_entities=num_entities,
        num_relations=max_relation + 1,
        names=False,
        ogb={
            "dataset": name,
            "negatives": negatives,
            "entity_types": {t: {"offset": o, "count": c} for t, (o, c) in types.items()} if typed else None,
        },
    )


def _offsets(data: dict, types: dict[str, tuple[int, int]], path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Each triple's head and tail type, as indices into the sorted types (int8)."""
    names = sorted(types)
    found = []
    for key in ("head_type", "tail_type"):
        seen, codes = np.unique(data[key], return_inverse=True)
        unknown = sorted(set(seen.tolist()) - set(names))
        if unknown:
            raise DatasetError(
                f"'{path}' names entity types {unknown[:5]} in {key} that the node counts lack (they have {names})",
                hint=_fresh(path),
            )
        found.append(np.searchsorted(names, seen)[codes].astype(np.int8))
    return found[0], found[1]


def _global(
    data: dict,
    key: str,
    rows: slice,
    type_index: np.ndarray | None,
    types: dict[str, tuple[int, int]],
    path: Path,
    *,
    answer: str | None = None,
) -> np.ndarray:
    """Rows ``rows`` of ``data[key]`` as global ids, each checked against its type's count."""
    ids = np.asarray(data[key][rows], dtype=np.int64)
    if type_index is None:
        offset, count = np.zeros(1, np.int64), np.array([types[""][1]], np.int64)
        which = np.zeros(len(ids), np.int64)
    else:
        names = sorted(types)
        offset = np.array([types[t][0] for t in names], np.int64)
        count = np.array([types[t][1] for t in names], np.int64)
        which = type_index[rows].astype(np.int64)
    limit = count[which].reshape((-1,) + (1,) * (ids.ndim - 1))
    bad = (ids < 0) | (ids >= limit)
    if bad.any():
        row, *col = np.argwhere(bad)[0].tolist()
        at = f"{key}[{rows.start + row}{', ' + str(col[0]) if col else ''}]"
        what = f" of type {sorted(types)[which[row]]!r}" if type_index is not None else ""
        raise DatasetError(
            f"'{path}': {at} is {int(ids[(row, *col)])}, outside the {int(count[which[row]]):,} entities{what}"
            + (f" (the {answer} query's answers' type)" if answer else ""),
            hint=_fresh(path),
        )
    return ids + offset[which].reshape((-1,) + (1,) * (ids.ndim - 1))


def _fresh(path: Path) -> str:
    return f"delete '{path}' (and the zip beside it) and run again to take it out of a fresh download"
