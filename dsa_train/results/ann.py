"""Approximate nearest-neighbour search over a run's table, through faiss (an optional extra).

:func:`open_index` builds a faiss index from one table of a checkpoint, streamed a chunk of
rows at a time, or loads the one a previous call saved. The index is faiss's own structure,
held in RAM: it stores every vector (``flat`` and ``ivf`` as float32, ``hnsw`` with its graph
links on top), so it serves tables that fit in memory; the exact search of
:meth:`~dsa_train.results.TrainedRun.neighbors` serves any size.

An index is saved as one file, ``<folder>/<table>.<metric>.ann``: a first line ``DSA-ANN 1``,
a JSON manifest line (run, checkpoint step, table, rows, dim, a digest of 64 of its rows,
metric, index type, recall@10),
then faiss's serialized index. It is written under a temporary name, fsynced and renamed, so it
is whole or absent. A saved index made for another checkpoint, table shape or index type is
rebuilt (and said so), never used; a file under that name that is not a saved index, or any
link on the way, is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import DsaError
from ..fsutil import atomic_write_bytes


class RunRows(Protocol):
    """What an index needs of a trained run (:class:`~dsa_train.results.TrainedRun` is one): its
    run folder (``run.path``), checkpoint step, tables' shapes, and their rows by id or in chunks.
    Named here so that this module imports nothing of the reader, which imports it."""

    run: Any
    step: int

    @property
    def tables(self) -> dict[str, tuple[int, int]]: ...

    def gather(self, table: str, ids: torch.Tensor) -> torch.Tensor: ...

    def chunks(self, table: str) -> Iterator[tuple[int, torch.Tensor]]: ...


logger = logging.getLogger(__name__)
MAGIC = b"DSA-ANN 1\n"
KINDS = ("flat", "ivf", "hnsw")
ANN_METRICS = ("cosine", "dot", "l2")
FLAT_BELOW = 20_000  # rows: below this the default index is exact (flat), a search is cheap anyway
RECALL_QUERIES = 200  # rows whose top 10 is compared with the exact top 10 at build time
RECALL_K = 10
HNSW_LINKS, HNSW_SEARCH = 32, 128
IVF_PROBE_SHARE = 1 / 16  # of the lists searched, at least 16


def faiss_module():
    """faiss, or a named error saying how to install it."""
    try:
        import faiss
    except ImportError:
        raise DsaError(
            "approximate search needs faiss, which is not installed",
            hint='pip install "dsa-train[faiss]" (faiss-cpu), or leave out --approximate',
        ) from None
    return faiss


@dataclass
class AnnIndex:
    """A faiss index of one table in one metric; :meth:`search` answers queries with it."""

    index: object
    manifest: dict
    path: Path
    built: bool  # True: built by this call; False: loaded from ``path``

    @property
    def recall(self) -> float:
        """Recall@10 against the exact answer, measured on a sample of rows when it was built."""
        return self.manifest["recall_at_10"]

    def search(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores, ids)`` of the ``k`` nearest rows of each query row; scores as the exact
        path gives them (cosine, dot, or the negative L2 distance), ``-inf``/``-1`` where
        the index found fewer than ``k``."""
        vectors = _prepared(queries, self.manifest["metric"])
        scores, ids = self.index.search(vectors, k)
        scores, ids = torch.from_numpy(scores), torch.from_numpy(ids)
        if self.manifest["metric"] == "l2":
            scores = -scores.clamp_min(0).sqrt()  # faiss gives squared distances
        return scores.masked_fill(ids < 0, float("-inf")), ids


def open_index(
    run: RunRows,
    table: str,
    metric: str,
    *,
    kind: str | None = None,
    folder: Path | None = None,
    effort: int | None = None,
) -> AnnIndex:
    """The saved index of ``run``'s ``table`` in ``metric`` under ``folder`` (default: the run
    folder's ``ann/``), built and saved first if there is none or it is stale. ``kind``:
    ``flat`` (exact), ``ivf`` (IVF-Flat) or ``hnsw``; default ``flat`` below 20,000 rows,
    ``hnsw`` above (its recall holds on tables without cluster structure, where IVF's drops);
    a saved index of another kind is rebuilt only when ``kind`` is given.

    ``effort``: how hard a search looks, traded against its time: the candidates an ``hnsw``
    search keeps (faiss's ``efSearch``, default 128) or the lists an ``ivf`` search probes
    (``nprobe``, default 1/16 of them, at least 16). It is a search setting, not saved with
    the index; the recall@10 is measured again at the effort given. What was built or loaded,
    and its recall@10, is logged."""
    faiss = faiss_module()
    if effort is not None and effort < 1:
        raise DsaError(
            f"the search effort must be at least 1, got {effort}",
            hint=f"e.g. {HNSW_SEARCH} (hnsw's default); higher finds more of the true neighbours, slower",
        )
    if metric not in ANN_METRICS:
        raise DsaError(
            f"approximate search supports the metrics {', '.join(ANN_METRICS)}, not {metric!r}",
            hint="pass --metric cosine, dot or l2, or search exactly (leave out --approximate)",
        )
    if kind is not None and kind not in KINDS:
        raise DsaError(
            f"index type must be one of {', '.join(KINDS)}, got {kind!r}",
            hint="hnsw (the default above 20,000 rows), ivf (smaller, faster to build), flat (exact)",
        )
    folder = Path(folder) if folder is not None else run.run.path / "ann"
    path = folder / f"{table}.{metric}.ann"
    rows, dim = run.tables[table]
    wanted = {
        "run": str(run.run.path.resolve()),
        "checkpoint": run.step,
        "table": table,
        "rows": rows,
        "dim": dim,
        "metric": metric,
        "fingerprint": _fingerprint(run, table, rows),
    }
    _refuse_links(folder, path)
    saved = _read_manifest(path)
    if saved is not None:
        same = all(saved.get(key) == value for key, value in wanted.items()) and kind in (None, saved.get("kind"))
        if same:
            _refuse_effort_on_flat(saved["kind"], effort)
            return _at_effort(run, table, AnnIndex(_read_index(faiss, path), saved, path, built=False), effort)
        logger.info(f"the index at {path} was made for {_describe(saved)}; rebuilding it for {_describe(wanted)}")
    kind = kind or ("flat" if rows < FLAT_BELOW else "hnsw")
    _refuse_effort_on_flat(kind, effort)
    index, settings = _build(faiss, run, table, metric, kind, rows, dim)
    manifest = {**wanted, "kind": kind, **settings}
    found = AnnIndex(index, manifest, path, built=True)
    manifest["recall_at_10"] = _recall(run, table, found)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _refuse_links(folder, path)
        _write(faiss, path, manifest, index)
    except OSError as e:
        raise DsaError(
            f"cannot save the index to '{path}': {e}",
            hint="give a writable folder with free space with --index-dir (folder=)",
        ) from None
    logger.info(
        f"built a {kind} index of {table} ({rows:,} rows, {metric}): recall@10 {manifest['recall_at_10']:.3f} against the exact answer "
        f"on {manifest['recall_queries']} rows; saved to {path}"
    )
    return _at_effort(run, table, found, effort)


def _refuse_effort_on_flat(kind: str, effort: int | None) -> None:
    if effort is not None and kind == "flat":
        raise DsaError(
            "a flat index compares every row: a search effort applies to ivf and hnsw indexes",
            hint="leave out the effort, or choose --index-type hnsw or ivf",
        )


def _at_effort(run: RunRows, table: str, found: AnnIndex, effort: int | None) -> AnnIndex:
    """``found`` searching with ``effort`` (unchanged for ``None``), its recall@10 measured again."""
    setting = {"hnsw": "ef_search", "ivf": "probes"}.get(found.manifest["kind"])
    if effort is None or setting is None or found.manifest[setting] == effort:
        return found
    if setting == "ef_search":
        found.index.hnsw.efSearch = effort
    else:
        effort = min(effort, found.manifest["lists"])
        found.index.nprobe = effort
    at_effort = AnnIndex(found.index, {**found.manifest, setting: effort}, found.path, found.built)
    at_effort.manifest["recall_at_10"] = _recall(run, table, at_effort)
    logger.info(
        f"searching with {setting} {effort}: recall@10 {at_effort.recall:.3f} against the exact answer on {at_effort.manifest['recall_queries']} rows"
    )
    return at_effort


def _build(faiss, run: RunRows, table: str, metric: str, kind: str, rows: int, dim: int) -> tuple[object, dict]:
    """A faiss index of the table, its rows added a chunk at a time."""
    inner = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    settings: dict = {}
    if kind == "flat":
        index = faiss.IndexFlat(dim, inner)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, HNSW_LINKS, inner)
        index.hnsw.efSearch = HNSW_SEARCH
        settings = {"links": HNSW_LINKS, "ef_search": HNSW_SEARCH}
    else:
        lists = max(1, min(int(4 * math.sqrt(rows)), rows // 39))  # faiss wants 39 training rows a list
        quantizer = faiss.IndexFlat(dim, inner)
        index = faiss.IndexIVFFlat(quantizer, dim, lists, inner)
        index.nprobe = min(lists, max(16, int(lists * IVF_PROBE_SHARE)))
        sample = torch.randperm(rows, generator=torch.Generator().manual_seed(0))[: min(rows, 64 * lists)].sort().values
        index.train(_prepared(run.gather(table, sample), metric))
        settings = {"lists": lists, "probes": index.nprobe}
    for _, block in run.chunks(table):
        index.add(_prepared(block, metric))
    return index, settings


def _recall(run: RunRows, table: str, found: AnnIndex) -> float:
    """Recall@10 of ``found`` on a sample of the table's rows, each left out of its own
    answer (as :meth:`neighbors` does), against an exact top 10 over the whole table."""
    rows = found.manifest["rows"]
    sample = torch.randperm(rows, generator=torch.Generator().manual_seed(1))[: min(rows, RECALL_QUERIES)]
    found.manifest["recall_queries"] = len(sample)
    k = min(RECALL_K, rows - 1)
    if k < 1:
        return 1.0
    queries = run.gather(table, sample)
    exact = exact_top_k(run, table, queries, sample, k, found.manifest["metric"])
    _, ids = found.search(queries, k + 1)
    hits = 0
    for row, own in enumerate(sample.tolist()):
        approximate = [i for i in ids[row].tolist() if i not in (own, -1)][:k]
        hits += len(set(approximate) & set(exact[row].tolist()))
    return hits / (k * len(sample))


def exact_top_k(
    run: RunRows, table: str, queries: torch.Tensor, own: torch.Tensor, k: int, metric: str
) -> torch.Tensor:
    """``(B, k)`` ids of the exact nearest rows of ``B`` query rows, row ``own[b]`` left out,
    with a running top-k over the table read a chunk at a time."""
    queries = F.normalize(queries, dim=1) if metric == "cosine" else queries
    best_scores, best_ids = torch.empty(len(queries), 0), torch.empty(len(queries), 0, dtype=torch.long)
    for start, block in run.chunks(table):
        block = F.normalize(block, dim=1) if metric == "cosine" else block
        scores = queries @ block.T
        if metric == "l2":
            scores = 2 * scores - (block * block).sum(1)  # -|q - x|^2 + |q|^2: the same order
        inside = (own >= start) & (own < start + len(block))
        scores[inside.nonzero().flatten(), own[inside] - start] = float("-inf")
        scores = torch.cat([best_scores, scores], 1)
        ids = torch.cat([best_ids, torch.arange(start, start + len(block)).expand(len(queries), -1)], 1)
        top = torch.topk(scores, min(k, scores.shape[1]), dim=1)
        best_scores, best_ids = top.values, ids.gather(1, top.indices)
    return best_ids


def _fingerprint(run: RunRows, table: str, rows: int) -> str:
    """A digest of 64 rows spread over the table: another checkpoint or run under the same
    folder, step and shape still gets another fingerprint."""
    ids = torch.linspace(0, rows - 1, min(rows, 64)).long()
    return hashlib.blake2b(run.gather(table, ids).float().numpy().tobytes(), digest_size=16).hexdigest()


def _prepared(vectors: torch.Tensor, metric: str) -> np.ndarray:
    """Rows as faiss takes them: contiguous float32, unit length for cosine."""
    vectors = vectors.detach().float()
    if metric == "cosine":
        vectors = F.normalize(vectors, dim=1)
    return np.ascontiguousarray(vectors.numpy(), dtype=np.float32)


def _describe(manifest: dict) -> str:
    text = f"run {manifest.get('run')!r} checkpoint {manifest.get('checkpoint')}, {manifest.get('table')} ({manifest.get('rows')} x {manifest.get('dim')}, rows digest {str(manifest.get('fingerprint'))[:8]})"
    return text + (f", {manifest['kind']}" if "kind" in manifest else "")


def _refuse_links(folder: Path, path: Path) -> None:
    for where in (folder, path):
        if where.is_symlink():
            raise DsaError(
                f"'{where}' is a symbolic link; an index is never written or read through one",
                hint="give a real folder with --index-dir",
            )
    if folder.exists() and not folder.is_dir():
        raise DsaError(f"index folder '{folder}' is not a folder", hint="give a folder with --index-dir")


def _read_manifest(path: Path) -> dict | None:
    """The manifest of a saved index at ``path``; ``None`` if there is none; an error if the
    file there is not a saved index (it is not ours to replace)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        head = f.read(len(MAGIC))
        line = f.readline() if head == MAGIC else b""
    try:
        manifest = json.loads(line)
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict):
        raise DsaError(
            f"'{path}' is not an index dsa-train saved",
            hint="move it away or give another --index-dir; nothing was changed",
        )
    return manifest


def _read_index(faiss, path: Path):
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        f.read(len(MAGIC))
        f.readline()
        data = np.frombuffer(f.read(), dtype=np.uint8)
    return faiss.deserialize_index(data)


def _write(faiss, path: Path, manifest: dict, index) -> None:
    """``path`` replaced whole: the header line, the manifest and the index (temporary name, fsync, rename)."""
    atomic_write_bytes(
        path,
        MAGIC + json.dumps(manifest, ensure_ascii=False).encode() + b"\n",
        memoryview(faiss.serialize_index(index)),
    )
