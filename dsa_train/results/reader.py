"""A finished run, opened for use: its tables, names, scores, predictions and neighbours.

:func:`open_run` reads one checkpoint of a run folder (the newest intact one by default, its
digests checked as ``eval`` checks them), never the live tables of a run that may still be
training. Memory tables come from the checkpoint's ``model.pt``; disk tables are read through
the checkpoint's chain of bases and deltas, row range by row range, so a table larger than
RAM is never loaded whole. Everything here is read-only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.clicks_import import click_columns, click_log_file, read_click_chunks
from ..errors import DsaError
from ..models import SCORING_FUNCTIONS, KGEModel
from ..recipe import with_data_root
from ..runs.checkpoint_store import CheckpointStore
from ..nn import DiskTable
from ..runs.run_folder import RunFolder, is_job
from ..train.tables import TableSite
from ..train.tasks import make_task
from .ann import AnnIndex, open_index
from .job import open_job
from .names import TableNames, table_shape, task_tables

CHUNK_ROWS = 1 << 16  # rows read at once when a table is streamed
METRICS = ("cosine", "dot", "l1", "l2")
SINGULAR = {"entities": "entity", "relations": "relation", "nodes": "node"}
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """One answer of :meth:`TrainedRun.predict` or :meth:`TrainedRun.neighbors`."""

    name: str
    id: int
    score: float
    known: bool = False  # a true triple of train, valid or test (``filter="mark"``)


def open_run(run: str | Path, checkpoint: int | None = None) -> TrainedRun:
    """Open a run folder that ``dsa-train run`` made, at ``checkpoint`` (a step; default: the
    newest intact checkpoint). Raises a :class:`~dsa_train.DsaError` naming what is wrong."""
    return TrainedRun(Path(run), checkpoint)


class TrainedRun:
    """A run's checkpoint, read-only. See :func:`open_run`.

    ``tables`` names the embedding tables (``entities``/``relations`` for knowledge graphs,
    ``nodes`` for node embeddings); :meth:`rows` streams one, :meth:`weights` returns it whole
    (for tables that fit in RAM); :meth:`names` and :meth:`ids` map rows and names."""

    def __init__(self, run_dir: Path, checkpoint: int | None = None) -> None:
        #: the warnings logged while the run was opened (a damaged newest checkpoint passed
        #: over, a moved data root), also kept here
        self.warnings: list[str] = []
        with _kept_warnings(self.warnings):
            self._open(run_dir, checkpoint)
        self.model: nn.Module = self.task.model.eval()
        self.kind: str = self.recipe.model.kind
        self.settings: dict = dataclasses.asdict(self.recipe.model)
        self._tables = task_tables(self.task, self.recipe)
        self._names = TableNames(self.task, self.recipe, self._tables)

    def _open(self, run_dir: Path, checkpoint: int | None) -> None:
        """The run folder, its recipe, the checkpoint and the task with its model loaded."""
        run = RunFolder.find(run_dir)
        self.run = run
        self.recipe = with_data_root(run.read_config(["train.device=cpu"]), stored=True)
        torch.manual_seed(self.recipe.train.seed)
        if is_job(run.path):  # a torchrun job: the ranks' shards, read by global id
            paths, self.step, self.task = open_job(run, self.recipe, checkpoint)
            self.path = paths[0]
        else:
            store = CheckpointStore(run.checkpoints)
            self.path, _, damaged = store.find(checkpoint)
            for text in damaged:
                logger.warning(f"warning: {text}")
            self.step = int(self.path.name)
            site = TableSite(store.get_tables_dir(self.path), writable=False, versions=store.table_versions(self.path))
            self.task = make_task(self.recipe, torch.device("cpu"), site)
            store.load_model(self.path, self.task.model)

    # -- tables -------------------------------------------------------------------------
    @property
    def tables(self) -> dict[str, tuple[int, int]]:
        """Each table's name and ``(rows, dim)``."""
        return {name: table_shape(module) for name, module in self._tables.items()}

    def rows(self, table: str, start: int = 0, stop: int | None = None) -> Tensor:
        """Rows ``[start, stop)`` of ``table``'s weights (float32 CPU tensor; a copy)."""
        module = self._table(table)
        total = table_shape(module)[0]
        stop = total if stop is None else min(stop, total)
        reader = getattr(module, "rows", None)
        if reader is not None and hasattr(reader, "range"):  # a disk table's checkpoint version
            return reader.range(start, stop).clone()
        if isinstance(module, (nn.Embedding, DiskTable)):
            return module.weight.detach()[start:stop].cpu().clone()
        return module(torch.arange(start, stop)).detach().cpu().clone()  # looked up by id: a slot table, a job's shards

    def chunks(self, table: str, chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[int, Tensor]]:
        """``(first_row, rows)`` pieces of ``table`` in order, ``chunk_rows`` at a time."""
        total = table_shape(self._table(table))[0]
        for start in range(0, total, chunk_rows):
            yield start, self.rows(table, start, start + chunk_rows)

    def weights(self, table: str) -> Tensor:
        """``table``'s whole ``(rows, dim)`` weight in RAM (use :meth:`chunks` for tables beyond it)."""
        return self.rows(table)

    # -- names --------------------------------------------------------------------------
    def names(self, table: str, ids: Sequence[int] | Tensor | None = None) -> list[str]:
        """The names of rows ``ids`` of ``table`` (all rows if ``None``); a graph without names
        gives its ids as text."""
        rows = table_shape(self._table(table))[0]
        ids = range(rows) if ids is None else ids
        return self._names.names(table, ids.tolist() if isinstance(ids, Tensor) else ids)

    def name_bytes(self, table: str, start: int, stop: int):
        """The names of rows ``[start, stop)`` as one UTF-8 blob and offsets into it (numpy;
        see :mod:`dsa_train.results.text_blobs`): :meth:`names` for many rows at once."""
        total = table_shape(self._table(table))[0]
        return self._names.name_bytes(table, start, min(stop, total))

    def lookup(self, table: str, names: Sequence[str]) -> list[int | None]:
        """The rows of ``names`` in ``table``, ``None`` for a name it does not have."""
        self._table(table)
        return self._names.lookup(table, names)

    def ids(self, table: str, names: Sequence[str]) -> list[int]:
        """The rows of ``names`` in ``table``; an unknown name is a ``DsaError`` listing the
        closest known names."""
        self._table(table)
        found = self._names.lookup(table, names)
        for name, row in zip(names, found):
            if row is None:
                raise DsaError(
                    f"{SINGULAR.get(table, 'row')} {name!r} is not in this run's {table}",
                    hint=self._closest(table, name),
                )
        return [int(row) for row in found]

    def gather(self, table: str, ids: Tensor) -> Tensor:
        """Rows ``ids`` (any order) of ``table``'s weights, as a float32 CPU tensor."""
        with torch.no_grad():
            return self._table(table)(ids.long()).detach().cpu().float().clone()

    # -- knowledge graphs ---------------------------------------------------------------
    def score(self, heads: Sequence, relations: Sequence, tails: Sequence) -> Tensor:
        """Scores of triples given by names (or ids), higher is more plausible: the model's
        own score function (TransE :math:`-\\lVert h + r - t \\rVert_p`, DistMult
        :math:`\\langle h, r, t \\rangle`, ComplEx :math:`\\mathrm{Re}\\langle h, r, \\bar t \\rangle`,
        RotatE :math:`-\\lVert h \\circ r - t \\rVert`)."""
        self._require_kg("score")
        h, r, t = (
            self._as_ids(table, values)
            for table, values in (("entities", heads), ("relations", relations), ("entities", tails))
        )
        if not len(h) == len(r) == len(t):
            raise DsaError(
                f"score needs as many heads, relations and tails; got {len(h)}, {len(r)} and {len(t)}",
                hint="pass three lists of one length",
            )
        with torch.no_grad():
            rel, side = self.model.query_relations(r, "tail")
            return self.model.answer_scores(self.model.entities(h), rel, self.model.entities(t), side).clone()

    def predict(
        self,
        *,
        head: str | int | None = None,
        relation: str | int,
        tail: str | int | None = None,
        k: int = 10,
        filter: bool | str = False,
        chunk_rows: int = CHUNK_ROWS,
    ) -> list[Answer]:
        """The ``k`` best answers of ``(head, relation, ?)`` or ``(?, relation, tail)``: exact,
        every entity scored, a chunk of ``chunk_rows`` rows at a time. ``filter=True`` leaves
        out answers known in train, valid or test (the filter of filtered ranking);
        ``filter="mark"`` keeps them, marked ``known``."""
        return self.predict_many([(head, relation, tail)], k=k, filter=filter, chunk_rows=chunk_rows)[0]

    def predict_many(
        self,
        queries: Sequence[tuple],
        *,
        k: int = 10,
        filter: bool | str = False,
        chunk_rows: int = CHUNK_ROWS,
    ) -> list[list[Answer]]:
        """:meth:`predict` for many ``(head, relation, None)`` / ``(None, relation, tail)``
        queries at once: one pass over the entity table answers all of them."""
        self._require_kg("predict")
        if k < 1:
            raise DsaError(f"k must be at least 1, got {k}", hint="e.g. k=10")
        if filter not in (False, True, "mark"):
            raise DsaError(
                f"filter must be False, True or 'mark', got {filter!r}", hint="filter=True drops known answers"
            )
        for head, _, tail in queries:
            if (head is None) == (tail is None):
                raise DsaError(
                    f"a query needs exactly one of its head and its tail, got head {head!r} and tail {tail!r}",
                    hint="ask (head, relation, ?) or (?, relation, tail), e.g. predict(head='/m/027rn', relation='/film/film/country')",
                )
        answers: list[list[Answer]] = [[] for _ in queries]
        for side in ("tail", "head"):
            picked = [i for i, (_, _, tail) in enumerate(queries) if (tail is None) == (side == "tail")]
            if not picked:
                continue
            anchors = self._as_ids("entities", [queries[i][0] if side == "tail" else queries[i][2] for i in picked])
            relations = self._as_ids("relations", [queries[i][1] for i in picked])
            known = (
                self.task.kg.filter_index().known(anchors, relations, side)
                if filter
                else (torch.zeros(0, dtype=torch.long),) * 2
            )
            scores, ids = self._top_k(anchors, relations, side, k, known if filter is True else None, chunk_rows)
            for row, i in enumerate(picked):
                marked = set(known[1][known[0] == row].tolist()) if filter == "mark" else set()
                keep = torch.isfinite(scores[row])
                top_ids, top_scores = ids[row][keep].tolist(), scores[row][keep].tolist()
                names = self.names("entities", top_ids)
                answers[i] = [Answer(n, e, s, e in marked) for n, e, s in zip(names, top_ids, top_scores)]
        return answers

    def _top_k(
        self, anchors: Tensor, relations: Tensor, side: str, k: int, drop, chunk_rows: int
    ) -> tuple[Tensor, Tensor]:
        """``(B, k)`` best scores and entity ids of ``B`` queries asking for ``side``, with a
        running top-k over the entity table read in chunks; ``drop``: ``(query, entity)`` pairs
        scored as ``-inf``."""
        model, batch = self.model, len(anchors)
        best_keys, best_ids = torch.empty(batch, 0), torch.empty(batch, 0, dtype=torch.long)
        with torch.no_grad():
            anchor_rows = model.entities(anchors)
            rel, side = model.query_relations(relations, side)
            for start, block in self.chunks("entities", chunk_rows):
                keys = model.ranking_keys(
                    anchor_rows, rel, model.constrain(block), side
                )  # ordered as the scores, fewer passes
                if drop is not None:
                    inside = (drop[1] >= start) & (drop[1] < start + len(block))
                    keys[drop[0][inside], drop[1][inside] - start] = float("-inf")
                chunk_top = torch.topk(keys, min(k, keys.shape[1]), dim=1)  # then merge k + k, not k + chunk
                keys = torch.cat([best_keys, chunk_top.values], 1)
                ids = torch.cat([best_ids, chunk_top.indices + start], 1)
                top = torch.topk(keys, min(k, keys.shape[1]), dim=1)
                best_keys, best_ids = top.values, ids.gather(1, top.indices)
        return model.scores_of_keys(best_keys), best_ids

    # -- click models -------------------------------------------------------------------
    def click_probabilities(self, path: str | Path) -> Iterator[Tensor]:
        r"""The click probability :math:`\sigma(\mathrm{logit})` of each impression of a click
        log in the run's format (its header names the run's columns; the label column may be
        left out), in file order, a chunk of impressions at a time."""
        if not self.recipe.is_recsys:
            raise DsaError(
                f"click probabilities come from a click model; model.kind {self.kind!r} is not one",
                hint="use predict() for knowledge graphs",
            )
        chunks = read_click_chunks(click_log_file(Path(path)), click_columns(self.recipe.dataset), need_label=False)
        features, dense_features = next(chunks)
        log = self.task.log
        if (features, dense_features) != (log.features, log.dense_features):
            raise DsaError(
                f"click log '{path}' has the categorical columns {features} and dense columns {dense_features}; "
                f"the run trained on {log.features} and {log.dense_features}",
                hint="score a file with the columns of the run's click log (the label column may be left out)",
            )
        with torch.no_grad():
            for labels, dense, lengths, ids, weights in chunks:
                bags = torch.from_numpy(lengths.reshape(-1))
                offsets = torch.zeros(len(bags), dtype=torch.long)
                torch.cumsum(bags[:-1], 0, out=offsets[1:])
                feature = torch.arange(len(features)).repeat(len(labels)).repeat_interleave(bags)
                rows = self.task.rows(torch.from_numpy(ids), feature)
                logits = self.model(
                    torch.from_numpy(dense), rows, offsets, None if weights is None else torch.from_numpy(weights)
                )
                yield torch.sigmoid(logits)

    # -- neighbours ---------------------------------------------------------------------
    @property
    def scoring(self) -> type[KGEModel] | None:
        """The scoring function of a knowledge-graph run (``None`` for other models)."""
        return SCORING_FUNCTIONS.get(self.kind) if self.recipe.is_kge else None

    @property
    def default_metric(self) -> str:
        """The geometry the model scored with: the scoring function's (L1 or L2 distance for
        TransE, its ``p_norm``, and RotatE; the dot product for DistMult and ComplEx), the dot
        product for skip-gram or GraphSAGE node vectors."""
        return self.scoring.metric(self.recipe.model) if self.scoring else "dot"

    def neighbors(
        self,
        name: str | int,
        *,
        k: int = 10,
        metric: str | None = None,
        table: str | None = None,
        chunk_rows: int = CHUNK_ROWS,
        approximate: bool | AnnIndex = False,
    ) -> list[Answer]:
        """The ``k`` rows of ``table`` (default: entities or nodes) nearest to ``name``'s, itself
        left out; exact, a chunk of rows at a time. ``metric``: ``cosine`` similarity, ``dot``
        product, or ``l1``/``l2`` distance, whose scores are the negative distances so that
        higher is nearer (default: :attr:`default_metric`). Rows are compared as stored (a
        model with ``normalize_entities`` scores their unit vectors: use ``cosine``).

        ``approximate=True`` searches the faiss index of :meth:`ann_index` instead (built and
        saved by the first call, its recall@10 printed); or pass an index it returned."""
        metric = metric or self.default_metric
        if metric not in METRICS:
            raise DsaError(
                f"metric must be one of {', '.join(METRICS)}, got {metric!r}",
                hint="cosine compares directions, l2 positions",
            )
        if k < 1:
            raise DsaError(f"k must be at least 1, got {k}", hint="e.g. k=10")
        table = table or next(iter(self._tables))
        row = int(self._as_ids(table, [name])[0])
        query = self.rows(table, row, row + 1)[0]
        if approximate is not False:
            index = self.ann_index(table, metric) if approximate is True else approximate
            if (index.manifest["table"], index.manifest["metric"], index.manifest["checkpoint"]) != (
                table,
                metric,
                self.step,
            ):
                raise DsaError(
                    f"the index given is of {index.manifest['table']} in {index.manifest['metric']} at checkpoint "
                    f"{index.manifest['checkpoint']}; this search is of {table} in {metric} at checkpoint {self.step}",
                    hint="pass approximate=True, or an index from run.ann_index(table, metric)",
                )
            scores, ids = index.search(query[None], k + 1)
            found = [(i, s) for i, s in zip(ids[0].tolist(), scores[0].tolist()) if i not in (row, -1)][:k]
            return [Answer(n, i, s) for n, (i, s) in zip(self.names(table, [i for i, _ in found]), found)]
        if metric == "cosine":
            query = F.normalize(query, dim=0)
        best_scores, best_ids = torch.empty(0), torch.empty(0, dtype=torch.long)
        for start, block in self.chunks(table, chunk_rows):
            if metric == "cosine":
                scores = F.normalize(block, dim=1) @ query
            elif metric == "dot":
                scores = block @ query
            else:
                scores = -(block - query).norm(p=int(metric[1]), dim=1)
            ids = torch.arange(start, start + len(block))
            if start <= row < start + len(block):
                scores[row - start] = float("-inf")
            scores, ids = torch.cat([best_scores, scores]), torch.cat([best_ids, ids])
            top = torch.topk(scores, min(k, len(scores)))
            best_scores, best_ids = top.values, ids[top.indices]
        keep = torch.isfinite(best_scores)
        best_scores, best_ids = best_scores[keep].tolist(), best_ids[keep].tolist()
        return [Answer(n, i, s) for n, i, s in zip(self.names(table, best_ids), best_ids, best_scores)]

    def ann_index(
        self,
        table: str | None = None,
        metric: str | None = None,
        *,
        kind: str | None = None,
        folder: str | Path | None = None,
        effort: int | None = None,
    ) -> AnnIndex:
        """A faiss index of ``table`` (default: entities or nodes) in ``metric`` (default:
        :attr:`default_metric`; ``cosine``, ``dot`` or ``l2``), for ``neighbors(...,
        approximate=index)``. Loaded from ``folder`` (default: the run folder's ``ann/``) when
        saved there for this checkpoint, else built from the table a chunk at a time, its
        recall@10 against the exact answer measured and logged, and saved. ``kind``: ``flat``,
        ``ivf`` or ``hnsw`` (default: ``flat`` below 20,000 rows, ``hnsw`` above). ``effort``:
        the search's ``efSearch`` (hnsw) or ``nprobe`` (ivf), higher for more recall at more
        time, the recall measured again at it. Needs ``pip install "dsa-train[faiss]"``."""
        table = table or next(iter(self._tables))
        self._table(table)
        folder = None if folder is None else Path(folder)
        return open_index(self, table, metric or self.default_metric, kind=kind, folder=folder, effort=effort)

    # -- helpers ------------------------------------------------------------------------
    def _table(self, table: str) -> nn.Module:
        if table not in self._tables:
            raise DsaError(f"this run has no table {table!r}", hint=f"its tables: {', '.join(self._tables)}")
        return self._tables[table]

    def _as_ids(self, table: str, values: Sequence | Tensor) -> Tensor:
        values = list(values.tolist() if isinstance(values, Tensor) else values)
        total = table_shape(self._table(table))[0]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            bad = [v for v in values if not 0 <= v < total]
            if bad:
                raise DsaError(
                    f"row {bad[0]} is outside {table} (0 to {total - 1:,})", hint="pass names, or ids from run.ids()"
                )
            return torch.tensor(values, dtype=torch.long)
        return torch.tensor(self.ids(table, [str(v) for v in values]), dtype=torch.long)

    def _closest(self, table: str, name: str) -> str:
        total = table_shape(self._table(table))[0]
        sample = self.names(table, range(min(total, 200_000)))  # a bounded look: names are in fingerprint order
        close = difflib.get_close_matches(str(name), sample, n=3, cutoff=0.6)
        return (
            f"did you mean {', '.join(map(repr, close))}?"
            if close
            else f"names look like {', '.join(map(repr, sample[:3]))}"
        )

    def _require_kg(self, what: str) -> None:
        if not self.recipe.is_kge:
            raise DsaError(
                f"{what} scores knowledge-graph triples; model.kind {self.kind!r} has none",
                hint="use neighbors() for node embeddings",
            )


class _KeptWarnings(logging.Handler):
    def __init__(self, kept: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.kept = kept

    def emit(self, record: logging.LogRecord) -> None:
        self.kept.append(record.getMessage())


@contextlib.contextmanager
def _kept_warnings(kept: list[str]) -> Iterator[None]:
    """Append to ``kept`` the message of each warning the library logs during the block."""
    handler, library = _KeptWarnings(kept), logging.getLogger("dsa_train")
    library.addHandler(handler)
    try:
        yield
    finally:
        library.removeHandler(handler)
