"""A finished run, opened for use: its tables, names, scores, predictions and neighbours.

:func:`open_run` reads one checkpoint of a run folder (the newest intact one by default, its
digests checked as ``eval`` checks them), never the live tables of a run that may still be
training. Memory tables come from the checkpoint's ``model.pt``; disk tables are read through
the checkpoint's chain of bases and deltas, row range by row range, so a table larger than
RAM is never loaded whole. Everything here is read-only.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import DsaError
from ..recipe import with_data_root
from ..train.checkpoint import TABLES, find_checkpoint, load_model_state, table_versions
from ..train.run_folder import RunFolder, is_job
from ..train.tables import TableSite
from ..train.tasks import make_task

CHUNK_ROWS = 1 << 16  # rows read at once when a table is streamed
METRICS = ("cosine", "dot", "l2")
SINGULAR = {"entities": "entity", "relations": "relation", "nodes": "node"}
INVERSE = "inverse:"  # the name of relation r's inverse, row r + R of a reciprocal model's table


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
        self.warnings: list[str] = []
        run = RunFolder.find(run_dir)
        if is_job(run.path):
            raise DsaError(
                f"'{run.path}' was trained over several processes: open_run reads one-process runs so far",
                hint="evaluate it with dsa-train eval (which starts its processes); reading its rows by global id is planned",
            )
        self.run = run
        self.recipe = with_data_root(run.read_config(["train.device=cpu"]), stored=True, note=self.warnings.append)
        if self.recipe.train.order == "partitioned":
            raise DsaError(
                f"'{run.path}' was trained in partition order: open_run does not map its partitions' slots back to ids yet",
                hint="dsa-train eval scores it; export of partition-ordered runs is planned",
            )
        if self.recipe.is_recsys:
            raise DsaError(
                f"'{run.path}' is a click model (model.kind {self.recipe.model.kind!r}): open_run reads embedding models so far",
                hint="dsa-train eval scores it",
            )
        self.path, _, damaged = find_checkpoint(run.checkpoints, checkpoint)
        self.warnings += [f"warning: {text}" for text in damaged]
        self.step = int(self.path.name)
        torch.manual_seed(self.recipe.train.seed)
        site = TableSite(self.path / TABLES, writable=False, versions=table_versions(self.path))
        self.task = make_task(self.recipe, torch.device("cpu"), site, note=self.warnings.append)
        load_model_state(self.path, self.task.model)
        self.model: nn.Module = self.task.model.eval()
        self.kind: str = self.recipe.model.kind
        self.settings: dict = dataclasses.asdict(self.recipe.model)
        self._tables = self._find_tables()

    # -- tables -------------------------------------------------------------------------
    @property
    def tables(self) -> dict[str, tuple[int, int]]:
        """Each table's name and ``(rows, dim)``."""
        return {name: (module.num_embeddings, module.embedding_dim) for name, module in self._tables.items()}

    def rows(self, table: str, start: int = 0, stop: int | None = None) -> Tensor:
        """Rows ``[start, stop)`` of ``table``'s weights (float32 CPU tensor; a copy)."""
        module = self._table(table)
        stop = module.num_embeddings if stop is None else min(stop, module.num_embeddings)
        reader = getattr(module, "rows", None)
        if reader is not None and hasattr(reader, "range"):  # a disk table's checkpoint version
            return reader.range(start, stop).clone()
        return module.weight.detach()[start:stop].clone()

    def chunks(self, table: str, chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[int, Tensor]]:
        """``(first_row, rows)`` pieces of ``table`` in order, ``chunk_rows`` at a time."""
        total = self._table(table).num_embeddings
        for start in range(0, total, chunk_rows):
            yield start, self.rows(table, start, start + chunk_rows)

    def weights(self, table: str) -> Tensor:
        """``table``'s whole ``(rows, dim)`` weight in RAM (use :meth:`chunks` for tables beyond it)."""
        return self.rows(table)

    # -- names --------------------------------------------------------------------------
    def names(self, table: str, ids: Sequence[int] | Tensor | None = None) -> list[str]:
        """The names of rows ``ids`` of ``table`` (all rows if ``None``); a graph without names
        gives its ids as text."""
        total = self._table(table).num_embeddings
        ids = range(total) if ids is None else [int(i) for i in ids]
        space = self._space(table)
        if space is None:
            return [str(i) for i in ids]
        graph = self.task.kg
        if space == "entities":
            return graph.entity_names(ids)
        base = graph.num_relations  # rows past it: the inverse relations of a reciprocal model
        names = graph.relation_names([i % base for i in ids])
        return [INVERSE + name if i >= base else name for i, name in zip(ids, names)]

    def ids(self, table: str, names: Sequence[str]) -> list[int]:
        """The rows of ``names`` in ``table``; an unknown name is a ``DsaError`` listing the
        closest known names."""
        space = self._space(table)
        if space is None:
            found = [int(n) if str(n).isdigit() and int(n) < self._table(table).num_embeddings else None for n in names]
        else:
            graph = self.task.kg
            if space == "entities":
                found = graph.entity_ids(list(names))
            else:
                inverse = [str(n).startswith(INVERSE) and self._table(table).num_embeddings > graph.num_relations for n in names]
                bare = graph.relation_ids([str(n)[len(INVERSE) :] if flip else n for n, flip in zip(names, inverse)])
                found = [None if row is None else row + graph.num_relations * flip for row, flip in zip(bare, inverse)]
        for name, row in zip(names, found):
            if row is None:
                raise DsaError(f"{SINGULAR.get(table, 'row')} {name!r} is not in this run's {table}", hint=self._closest(table, name))
        return [int(row) for row in found]

    # -- knowledge graphs ---------------------------------------------------------------
    def score(self, heads: Sequence, relations: Sequence, tails: Sequence) -> Tensor:
        """Scores of triples given by names (or ids), higher is more plausible: the model's
        own score function (TransE :math:`-\\lVert h + r - t \\rVert_p`, DistMult
        :math:`\\langle h, r, t \\rangle`, ComplEx :math:`\\mathrm{Re}\\langle h, r, \\bar t \\rangle`,
        RotatE :math:`-\\lVert h \\circ r - t \\rVert`)."""
        self._require_kg("score")
        h, r, t = (self._as_ids(table, values) for table, values in (("entities", heads), ("relations", relations), ("entities", tails)))
        if not len(h) == len(r) == len(t):
            raise DsaError(f"score needs as many heads, relations and tails; got {len(h)}, {len(r)} and {len(t)}", hint="pass three lists of one length")
        with torch.no_grad():
            rel, side = self.model.query_relations(r, "tail")
            return self.model.answer_scores(self.model.entities(h), rel, self.model.entities(t), side).clone()

    def predict(
        self, *, head: str | int | None = None, relation: str | int, tail: str | int | None = None, k: int = 10,
        filter: bool | str = False, chunk_rows: int = 1 << 20,
    ) -> list[Answer]:  # fmt: skip
        """The ``k`` best answers of ``(head, relation, ?)`` or ``(?, relation, tail)``, exact,
        scoring every entity in chunks of ``chunk_rows``. ``filter=True`` leaves out answers
        known in train, valid or test (the filter of filtered ranking); ``filter="mark"``
        keeps them, marked ``known``."""
        self._require_kg("predict")
        if (head is None) == (tail is None):
            raise DsaError("predict needs exactly one of head= and tail=", hint="e.g. predict(head='/m/027rn', relation='/film/film/country')")
        if k < 1:
            raise DsaError(f"k must be at least 1, got {k}", hint="e.g. k=10")
        if filter not in (False, True, "mark"):
            raise DsaError(f"filter must be False, True or 'mark', got {filter!r}", hint="filter=True drops known answers")
        side = "tail" if tail is None else "head"
        anchor = self._as_ids("entities", [head if side == "tail" else tail])
        rel = self._as_ids("relations", [relation])
        known = torch.zeros(0, dtype=torch.long)
        if filter:
            _, known = self.task.kg.filter_index().known(anchor, rel, side)
        total = self.task.kg.num_entities
        best_scores, best_ids = torch.empty(0), torch.empty(0, dtype=torch.long)
        with torch.no_grad():
            for start in range(0, total, chunk_rows):
                candidates = torch.arange(start, min(start + chunk_rows, total))
                scores = self.model.score_entities(anchor, rel, candidates, side)[0]
                if filter is True and len(known):
                    inside = known[(known >= start) & (known < start + len(candidates))]
                    scores[inside - start] = float("-inf")
                scores, order = torch.cat([best_scores, scores]), torch.cat([best_ids, candidates])
                top = torch.topk(scores, min(k, len(scores)))
                best_scores, best_ids = top.values, order[top.indices]
        keep = torch.isfinite(best_scores)
        best_scores, best_ids = best_scores[keep], best_ids[keep]
        names = self.names("entities", best_ids)
        known_set = set(known.tolist()) if filter == "mark" else set()
        return [Answer(n, int(i), float(s), int(i) in known_set) for n, i, s in zip(names, best_ids, best_scores)]

    # -- neighbours ---------------------------------------------------------------------
    def neighbors(self, name: str | int, *, k: int = 10, metric: str = "cosine", table: str | None = None, chunk_rows: int = 1 << 20) -> list[Answer]:
        """The ``k`` rows nearest to ``name``'s (itself left out), exact, in chunks: by
        ``cosine`` similarity, ``dot`` product, or ``l2`` distance (scores are then the
        negative distances, so that higher is nearer)."""
        if metric not in METRICS:
            raise DsaError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}", hint="metric='cosine' compares directions, 'l2' positions")
        if k < 1:
            raise DsaError(f"k must be at least 1, got {k}", hint="e.g. k=10")
        table = table or next(iter(self._tables))
        row = self._as_ids(table, [name])[0]
        query = self.rows(table, row, row + 1)[0]
        if metric == "cosine":
            query = F.normalize(query, dim=0)
        best_scores, best_ids = torch.empty(0), torch.empty(0, dtype=torch.long)
        for start, block in self.chunks(table, chunk_rows):
            if metric == "cosine":
                scores = F.normalize(block, dim=1) @ query
            elif metric == "dot":
                scores = block @ query
            else:
                scores = -(block - query).norm(dim=1)
            ids = torch.arange(start, start + len(block))
            scores[ids == row] = float("-inf")
            scores, order = torch.cat([best_scores, scores]), torch.cat([best_ids, ids])
            top = torch.topk(scores, min(k, len(scores)))
            best_scores, best_ids = top.values, order[top.indices]
        keep = torch.isfinite(best_scores)
        best_scores, best_ids = best_scores[keep], best_ids[keep]
        return [Answer(n, int(i), float(s)) for n, i, s in zip(self.names(table, best_ids), best_ids, best_scores)]

    # -- helpers ------------------------------------------------------------------------
    def _find_tables(self) -> dict[str, nn.Module]:
        model = self.model
        if self.recipe.is_kge:
            return {"entities": model.node_emb, "relations": model.rel_emb}
        return {"nodes": model.embedding}

    def _table(self, table: str) -> nn.Module:
        if table not in self._tables:
            raise DsaError(f"this run has no table {table!r}", hint=f"its tables: {', '.join(self._tables)}")
        return self._tables[table]

    def _space(self, table: str) -> str | None:
        """Where ``table``'s names live in the dataset (``None``: rows are their own names)."""
        self._table(table)
        return table if self.recipe.is_kge else None

    def _as_ids(self, table: str, values: Sequence | Tensor) -> Tensor:
        values = list(values.tolist() if isinstance(values, Tensor) else values)
        total = self._table(table).num_embeddings
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            bad = [v for v in values if not 0 <= v < total]
            if bad:
                raise DsaError(f"row {bad[0]} is outside {table} (0 to {total - 1:,})", hint="pass names, or ids from run.ids()")
            return torch.tensor(values, dtype=torch.long)
        return torch.tensor(self.ids(table, [str(v) for v in values]), dtype=torch.long)

    def _closest(self, table: str, name: str) -> str:
        total = self._table(table).num_embeddings
        sample = self.names(table, range(min(total, 200_000)))  # a bounded look: names are in fingerprint order
        close = difflib.get_close_matches(str(name), sample, n=3, cutoff=0.6)
        return f"did you mean {', '.join(map(repr, close))}?" if close else f"names look like {', '.join(map(repr, sample[:3]))}"

    def _require_kg(self, what: str) -> None:
        if not self.recipe.is_kge:
            raise DsaError(f"{what} scores knowledge-graph triples; model.kind {self.kind!r} has none", hint="use neighbors() for node embeddings")
