"""Knowledge-graph embedding as a training task: triples in, filtered ranking metrics out.

A batch is positive triples; each asks its tail query (h, r, ?) and its head query
(?, r, t), scored against negatives shared by the step (uniform samples plus, by default,
the step's other answers), with the recipe's loss and optional N3 regularisation. With
``train.candidates: all`` the queries are scored against every entity instead (1-vs-all), and
with ``train.labels: all`` a batch is distinct queries, each labelled with all its training
answers (k-vs-all).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from .. import progress
from ..data import KnowledgeGraph, load_knowledge_graph
from ..data.kg_queries import DistinctQueries, QueryBatch
from ..data.order import Shuffle
from ..errors import DatasetError
from ..eval import RankingMetrics, TripleIndex, evaluate_link_prediction
from ..eval.ogb_protocol import evaluate_ogb
from ..eval.ranking import RankingScope, ScoreFn
from ..fsutil import atomic_write_bytes
from ..models import SCORING_FUNCTIONS, KGEModel, build_kge_model
from ..models.early_gradients import sum_with_early_gradients
from ..models.losses import every_entity_loss, ranking_loss
from ..recipe import Recipe
from .sizes import FLOAT_BYTES, Working, check_sizes, keys_of
from .tables import TableSite, WholeTable
from .task import Task

logger = logging.getLogger(__name__)

#: scores a slice of a step's queries makes at once by default (8 MiB of float32): the fastest
#: size measured on CPU, 3x faster than a whole (4096, 8192) step (docs/performance.md)
SLICE_SCORES = 1 << 21


def kge_working(recipe: Recipe, train_triples: int, eval_triples: int, num_entities: int) -> list[Working]:
    """What a training step and an evaluation batch hold at once (see :meth:`KGETask.loss` and
    :func:`~dsa_train.eval.ranking.query_ranks`), from the recipe's sizes.

    A step scores ``2 n`` queries (``n`` triples, at most the training set; with
    ``train.labels: all``, ``train.batch_size`` queries) against ``K`` candidates
    (``train.negatives``, plus the step's ``2 n`` answers with ``train.batch_negatives``; with
    ``train.candidates: all``, a chunk of ``train.entity_chunk`` entities at a time): the
    ``2n x K`` scores, their intermediates, the loss's copies and the gradients of each come to
    at most 8 such matrices (measured: 4.3 to 7.5), plus the gathered rows of ``model.dim``
    floats and their gradients (4 copies; every entity's with ``candidates: all``)."""
    t, e, dim = recipe.train, recipe.eval, recipe.model.dim
    n = min(t.batch_size, max(train_triples, 1))
    queries = min(t.batch_size, 2 * max(train_triples, 1)) if t.labels == "all" else 2 * n
    per_step = f" (at most {n:,} triples per step)" if n < t.batch_size and t.labels == "one" else ""
    if t.candidates == "all":
        candidates = min(t.entity_chunk, num_entities)
        rows = (
            2 * queries + num_entities + queries
        )  # anchors, answers (one a query with labels one), every entity, relation rows
        width_keys = keys_of(train__entity_chunk=t.entity_chunk, model__dim=dim)
        step_hint = (
            "lower train.entity_chunk or train.batch_size (a step scores its queries against entity_chunk entities at a time), "
            "or go back to train.candidates: sampled; or lower model.dim (every entity's model.dim floats are gathered each step)"
        )
    else:
        candidates = t.negatives + (queries if t.batch_negatives else 0)
        rows = 4 * n + t.negatives + candidates + queries  # anchors, answers, negatives, their concat, relation rows
        width_keys = keys_of(train__negatives=t.negatives, model__dim=dim)
        step_hint = (
            "lower train.query_chunk (a step scores that many queries at a time; by default as many as make "
            f"{SLICE_SCORES:,} scores); or lower train.batch_size or train.negatives: a step scores 2 x batch_size queries against negatives"
            + (
                " + 2 x batch_size candidates (train.batch_negatives: false drops the 2 x batch_size)"
                if t.batch_negatives
                else " candidates"
            )
            + "; or lower model.dim (a step gathers model.dim floats for each of them)"
        )
    scored_at_once = min(queries, query_chunk(t, candidates)) if t.candidates == "sampled" else queries
    step = FLOAT_BYTES * (8 * scored_at_once * candidates + 4 * rows * dim)
    step_keys = keys_of(train__batch_size=t.batch_size) + per_step + ", " + width_keys
    against = "entities at a time" if t.candidates == "all" else "candidates"
    if scored_at_once < queries:
        against += f", {scored_at_once:,} queries at a time"
        step_keys += ", " + (
            keys_of(train__query_chunk=t.query_chunk) if t.query_chunk else "train.query_chunk (default)"
        )
    working = [
        Working(f"one training step ({queries:,} queries x {candidates:,} {against})", step, step_keys, step_hint)
    ]
    b = min(e.batch_size, max(eval_triples, 1))
    if e.sampled_negatives is not None:
        chunk, chunk_key = (
            min(e.sampled_negatives + b, num_entities),
            keys_of(eval__sampled_negatives=e.sampled_negatives),
        )
    else:
        chunk, chunk_key = min(e.entity_chunk, num_entities), keys_of(eval__entity_chunk=e.entity_chunk)
    # the score buffer, the comparison flags and a scoring function's own matrix (TransE's
    # L1 distances); the chunk's rows, gathered and constrained; the queries
    ranking = FLOAT_BYTES * (3 * b * chunk + 3 * chunk * dim + 2 * b * dim)
    working.append(
        Working(
            f"one evaluation batch ({b:,} queries x {chunk:,} entities)",
            ranking,
            f"{keys_of(eval__batch_size=e.batch_size)}, {chunk_key}, {keys_of(model__dim=dim)}",
            "lower eval.batch_size or eval.entity_chunk (or eval.sampled_negatives): an evaluation batch scores batch_size queries against a chunk of entities",
        )
    )
    return working


def sampled_loss(
    model: KGEModel, cfg, sides, candidates: Tensor, masked: Tensor, *, total: int | None = None
) -> Tensor:
    """The loss of queries against candidates they share (:func:`~dsa_train.models.losses.ranking_loss`),
    written once for every KGE task.

    ``sides``: per side the queries score, ``(anchors, relations, answers, side)``, their rows
    as the scores see them (dropout applied); ``candidates``: ``(K, D)`` rows; ``masked``:
    ``(Q, K)``, True where a candidate is the query's own answer (queries in the order of
    ``sides``); ``cfg``: the recipe's ``train`` section (loss, margin, query_chunk). ``total``:
    divide the sum over the queries by it instead of taking their mean (a slice's share of a
    batch).

    Queries are scored :func:`query_chunk` at a time, each slice's gradient taken as it is
    scored (:mod:`~dsa_train.models.early_gradients`): a step holds one slice's ``(chunk, K)``
    scores and their intermediates, not all ``Q``, and computes nothing twice. The loss is the
    same sum over queries, added in another order (equal up to float rounding); with one slice
    it is the unsliced loss bit for bit."""
    queries = sum(len(anchors) for anchors, *_ in sides)
    chunk = query_chunk(cfg, len(candidates))
    if chunk >= queries:
        positive, negative = [], []
        for anchors, relations, answers, side in sides:
            scores = model.scores_with_answers(anchors, relations, answers, candidates, side)
            positive.append(scores[0])
            negative.append(scores[1])
        return ranking_loss(
            cfg.loss,
            torch.cat(positive),
            torch.cat(negative),
            masked,
            margin=cfg.margin,
            total=total,
            label_smoothing=cfg.label_smoothing,
        )

    def slice_loss(
        side: str, masked_rows: Tensor, anchors: Tensor, relations: Tensor, answers: Tensor, candidates: Tensor
    ) -> Tensor:
        positive, negative = model.scores_with_answers(anchors, relations, answers, candidates, side)
        return ranking_loss(
            cfg.loss,
            positive,
            negative,
            masked_rows,
            margin=cfg.margin,
            total=total or queries,
            label_smoothing=cfg.label_smoothing,
        )

    terms, offset = [], 0
    for anchors, relations, answers, side in sides:
        for start in range(0, len(anchors), chunk):
            rows = slice(start, min(start + chunk, len(anchors)))
            masked_rows = masked[offset + rows.start : offset + rows.stop]
            terms.append((partial(slice_loss, side, masked_rows), (anchors[rows], relations[rows], answers[rows])))
        offset += len(anchors)
    return sum_with_early_gradients(terms, (candidates,), model.parameters())


def query_chunk(cfg, candidates: int) -> int:
    """How many queries a step scores at a time against ``candidates`` shared candidates:
    ``train.query_chunk``, or by default as many as make :data:`SLICE_SCORES` scores (at least
    one). It depends on the recipe's sizes alone, never on the machine, so that a resumed run
    adds its losses in the same order."""
    return cfg.query_chunk or max(1, SLICE_SCORES // max(candidates, 1))


class RankingForecast:
    """The ranking's progress callback: advances the evaluation's bar and, after the first batch
    of a full ranking that will take over a minute, says how long (the bar alone is not seen in
    a log, and full ranking over 10^8 entities can take hours)."""

    def __init__(self, total: int, num_entities: int, *, sampled: bool) -> None:
        self.total, self.num_entities, self.sampled = total, num_entities, sampled
        self.started, self.done = time.perf_counter(), 0

    def __call__(self, done: int) -> None:
        first = self.done == 0
        self.done += done
        progress.current().eval_advance(done)
        if first and not self.sampled and self.done < self.total:
            seconds = (time.perf_counter() - self.started) / self.done * self.total
            if seconds > 60:
                logger.info(
                    f"full ranking of {self.total:,} queries against all {self.num_entities:,} entities will take about "
                    f"{seconds / 60:,.0f} minutes; eval.sampled_negatives: K ranks against K sampled entities instead"
                )


class KGETask(Task):
    saves_ranks = True

    def __init__(
        self, recipe: Recipe, device: torch.device, tables: TableSite | None = None, *, layout=WholeTable
    ) -> None:
        """``layout(num_entities)``: where this process's entity rows are (:class:`~.tables.WholeTable`)."""
        self.recipe, self.device = recipe, device
        self.unit = "queries" if recipe.train.labels == "all" else "triples"  # what an epoch item is
        self.kg: KnowledgeGraph = load_knowledge_graph(recipe.dataset)
        self.description = str(self.kg)
        kg, dim = self.kg, recipe.model.dim
        self.layout = layout(kg.num_entities)
        relation_rows = (2 if recipe.model.reciprocal else 1) * kg.num_relations + (
            1 if recipe.model.embedding_storage == "disk" else 0
        )
        relation_width = SCORING_FUNCTIONS.get(recipe.model.kind).relation_width(dim)
        relation_state = 3 if recipe.optimizer.kind == "sparse_adam" else 1
        check_sizes(
            recipe,
            device,
            tables,
            table="entities",
            rows=self.layout.rows_here,
            other=relation_rows * relation_width * FLOAT_BYTES * relation_state,
            other_what="the relation table",
            working=kge_working(recipe, len(kg.train), max(len(kg.valid), len(kg.test)), kg.num_entities),
        )
        entities = self.layout.make_table(recipe, tables, "entities", std=recipe.model.init_std)
        self.model: KGEModel = build_kge_model(recipe.model, self.kg.num_entities, self.kg.num_relations, entities).to(
            device
        )
        self.index: TripleIndex | None = None
        self.distinct: DistinctQueries | None = None

    def train_rows(self, picked: Tensor) -> Tensor:
        """The training triples of epoch items ``picked`` (int64)."""
        return self.kg.rows("train", picked)

    def draw_negatives(self, count: int) -> Tensor:
        """``count`` entities drawn uniformly from the whole table."""
        return torch.randint(0, self.kg.num_entities, (count,), device=self.device)

    def prefetch(self, picked: Tensor) -> None:
        """Read the next batch's rows ahead; with every entity a candidate every row is read
        at every step, so there is nothing to pick out."""
        if self.recipe.train.candidates == "sampled":
            self.model.node_emb.prefetch(self.train_rows(picked)[:, [0, 2]].flatten())

    def sparse_parameters(self) -> list[tuple[str, Tensor]]:
        return list(self.model.named_parameters())

    def epoch_items(self) -> int:
        """Training triples, or with k-vs-all the distinct queries."""
        return len(self.distinct_queries()) if self.recipe.train.labels == "all" else len(self.kg.train)

    def distinct_queries(self) -> DistinctQueries:
        """k-vs-all's items: the training split's distinct queries (built once)."""
        if self.distinct is None:
            self.distinct = DistinctQueries(self.kg.train, self.kg.num_entities, self.kg.num_relations)
        return self.distinct

    def loss(self, picked: Tensor) -> Tensor:
        """The step's loss over epoch items ``picked``: against sampled negatives, or every entity."""
        if self.recipe.train.candidates == "all":
            return self.every_entity_loss(self.queries(picked))
        return self.sampled_loss(picked)

    def queries(self, picked: Tensor) -> QueryBatch:
        """The queries of epoch items ``picked`` with their answers: each triple's tail and head
        query with its one answer (1-vs-all), or each distinct query with all of its (k-vs-all)."""
        if self.recipe.train.labels == "all":
            return self.distinct_queries().batch(picked)
        heads, relations, tails = self.train_rows(picked).unbind(1)
        n = len(heads)
        return QueryBatch(
            torch.cat([heads, tails]),
            torch.cat([relations, relations]),
            n,
            torch.arange(2 * n),
            torch.cat([tails, heads]),
        )

    def every_entity_loss(self, batch: QueryBatch) -> Tensor:
        """The loss of queries scored against every entity, ``train.entity_chunk`` entities at a
        time (:func:`~dsa_train.models.losses.every_entity_loss`); every entity row gets a gradient."""
        cfg, model, device, count = self.recipe.train, self.model, self.device, self.kg.num_entities
        anchors, relations = batch.anchors.to(device), batch.relations.to(device)
        label_query, label_entity = batch.label_query.to(device), batch.label_entity.to(device)
        q, k = len(anchors), len(label_entity)
        embedded = model.embed(torch.cat([anchors, label_entity, torch.arange(count, device=device)]))
        anchor_emb, answer_emb, entity_emb = embedded.split([q, k, count])  # see sampled_loss
        sides = batch.sides()
        rel_emb, scored_sides = zip(
            *(model.query_relations(relations[rows], side) for side, rows in sides)
        )  # one mask per query
        rel_emb = torch.cat(rel_emb)

        def score_chunk(start: int, stop: int) -> Tensor:
            return torch.cat(
                [
                    model.score_sets(anchor_emb[rows], rel_emb[rows], entity_emb[start:stop], scored)
                    for (_, rows), scored in zip(sides, scored_sides)
                ]
            )

        tail_labels = int((label_query < batch.tails).sum())  # labels come grouped by query, tail queries first
        answer_scores = torch.cat(
            [
                model.answer_scores(
                    anchor_emb[label_query[labels]], rel_emb[label_query[labels]], answer_emb[labels], scored
                )
                for scored, labels in zip(scored_sides, (slice(0, tail_labels), slice(tail_labels, k)))
            ]
        )
        loss = every_entity_loss(
            cfg.loss,
            score_chunk,
            answer_scores,
            label_query,
            label_entity,
            num_queries=q,
            num_entities=count,
            chunk=cfg.entity_chunk,
            margin=cfg.margin,
            label_smoothing=cfg.label_smoothing,
        )
        if cfg.regularization:
            loss = loss + cfg.regularization * self.n3_penalty(anchor_emb, answer_emb, relations, sides)
        return loss

    def n3_penalty(self, anchor_emb: Tensor, answer_emb: Tensor, relations: Tensor, sides) -> Tensor:
        """N3 (Lacroix et al., 2018) on a step's anchor and answer rows and its queries' relation
        rows, per query."""
        model = self.model
        rel_rows = torch.cat([model.relation_for(relations[rows], side)[0] for side, rows in sides])
        return model.n3(torch.cat([anchor_emb, answer_emb]), model.rel_emb(rel_rows)) / len(relations)

    def sampled_loss(self, picked: Tensor) -> Tensor:
        """Each triple's tail and head query against the step's shared sampled negatives."""
        cfg, model = self.recipe.train, self.model
        batch = self.queries(picked)  # every triple asks its tail query (h, r, ?) and its head query (?, r, t)
        anchors, relations, answers = (
            column.to(self.device) for column in (batch.anchors, batch.relations, batch.label_entity)
        )
        negatives = self.draw_negatives(cfg.negatives)
        n, sides = batch.tails, batch.sides()
        # One lookup, cut with split, not slicing: a slice's gradient is a zero matrix of the
        # whole lookup with the slice copied in, where split's is the parts' concatenation
        # (slicing took a quarter of a FB15k-237 DistMult step's CPU time)
        embedded = model.embed(torch.cat([anchors, answers, negatives]))
        anchor_emb, answer_emb, negative_emb = embedded.split([2 * n, 2 * n, len(negatives)])
        if cfg.batch_negatives:  # the other queries' answers: negatives drawn by popularity
            negatives, negative_emb = torch.cat([answers, negatives]), torch.cat([answer_emb, negative_emb])
        sizes = [rows.stop - rows.start for _, rows in sides]
        queries = []
        for (side, rows), anchor_rows, answer_rows in zip(sides, anchor_emb.split(sizes), answer_emb.split(sizes)):
            rel_emb, scored = model.query_relations(relations[rows], side)  # one mask per query
            queries.append((anchor_rows, rel_emb, answer_rows, scored))
        masked = answers[:, None] == negatives[None, :]  # a negative that is the query's own answer
        loss = sampled_loss(model, cfg, queries, negative_emb, masked)
        if cfg.regularization:
            loss = loss + cfg.regularization * self.n3_penalty(anchor_emb, answer_emb, relations, sides)
        return loss

    def evaluate(self, split: str, *, final: bool) -> dict[str, dict]:
        """Filtered ranking of a split (sides ``tail``, ``head``, ``both``), and/or OGB's
        protocol (group ``ogb``), as ``eval.protocol`` says; during training at most
        ``eval.max_queries`` triples (the same ones for both)."""
        cfg = self.recipe.eval
        triples = self.kg.split(split)
        limit = None if final else cfg.max_queries
        picked = slice(None)
        if limit is not None and len(triples) > limit:
            picked = Shuffle(len(triples), self.recipe.train.seed).slice(0, limit)
        triples = self.kg.rows(split, picked)
        groups: dict[str, dict] = {}
        if cfg.protocol in ("filtered", "both"):
            groups.update(self.filtered_ranking(split, triples))
        if cfg.protocol in ("ogb", "both"):
            groups["ogb"] = self.ogb_ranking(split, triples, picked)
        return groups

    def filtered_ranking(self, split: str, triples: Tensor) -> dict[str, dict]:
        """Filtered ranking of ``triples`` of a split against every entity (or a sample)."""
        cfg = self.recipe.eval
        if self.index is None:  # every true triple of every split: what filtered ranking filters out
            self.index = self.kg.filter_index()
        progress.current().eval_start(split, 2 * len(triples))
        score_fn, scope = self.ranking()
        ranks: dict[str, Tensor] = {}
        metrics: dict[str, RankingMetrics] = evaluate_link_prediction(
            score_fn,
            triples,
            self.index,
            num_entities=self.kg.num_entities,
            batch_size=cfg.batch_size,
            entity_chunk=cfg.entity_chunk,
            sampled_negatives=cfg.sampled_negatives,
            seed=self.recipe.train.seed,
            progress=RankingForecast(2 * len(triples), self.kg.num_entities, sampled=cfg.sampled_negatives is not None),
            scope=scope,
            ranks_out=ranks,
        )
        self.last_ranks = (triples, ranks)  # for `eval --save-ranks`
        return {side: m.as_dict() for side, m in metrics.items()}

    def ogb_ranking(self, split: str, triples: Tensor, picked) -> dict:
        """OGB's protocol (:mod:`~dsa_train.eval.ogb_protocol`): each query against the split's
        fixed negatives, read from the dataset a batch at a time."""
        negatives = self.kg.fixed_negatives(split)
        if negatives is None:
            raise DatasetError(
                f"eval.protocol: {self.recipe.eval.protocol} ranks against OGB's fixed negatives, and the {split} split "
                f"of '{self.kg.name}' has none",
                hint="use eval.protocol: filtered, or an OGB dataset (dataset.kind: ogbl)",
            )
        head_neg, tail_neg = negatives
        if not isinstance(picked, slice):  # a seeded sample during training: the same rows of the negatives
            order = picked.numpy()
            head_neg, tail_neg = head_neg[order], tail_neg[order]
        progress.current().eval_start(f"{split} (OGB)", 2 * len(triples))
        metrics = evaluate_ogb(
            self.score_each(),
            triples,
            head_neg,
            tail_neg,
            batch_size=max(1, self.recipe.eval.batch_size // 4),
            progress=progress.current().eval_advance,
        )
        return metrics.as_dict()

    def score_each(self):
        """How OGB's protocol scores: each query against candidate ids of its own, ``(B, K)``."""
        model = self.model
        if self.layout.rows_here != self.kg.num_entities:
            raise DatasetError(
                "eval.protocol: ogb scores each query against its own negatives, which needs every entity row in this "
                "process; a sharded (torchrun) run does not have them",
                hint="evaluate the finished run in one process (dsa-train eval), or use eval.protocol: filtered",
            )

        def score(anchor: Tensor, relation: Tensor, candidates: Tensor, side: str) -> Tensor:
            device = model.rel_emb.weight.device
            b, k = candidates.shape
            rel, scored = model.query_relations(relation.to(device), side)
            anchors = model.entities(anchor.to(device))
            rows = model.entities(candidates.reshape(-1).to(device))
            return model.answer_scores(
                anchors.repeat_interleave(k, 0), rel.repeat_interleave(k, 0), rows, scored
            ).reshape(b, k)

        return score

    def write_ranks(self, path: Path) -> int:
        """Write the last evaluation's per-query ranks to ``path`` as TSV (atomically): a
        header, then one line per query, ``side head relation tail rank``, ids as in the
        dataset (tail queries first, then head queries, each in the split's order). Returns
        the lines written."""
        if getattr(self, "last_ranks", None) is None:
            raise DatasetError(
                "no filtered ranks to write: eval.protocol is 'ogb', which ranks against fixed negatives only",
                hint="run the evaluation with --set eval.protocol=both to write the filtered ranks",
            )
        triples, ranks = self.last_ranks
        lines = ["side\thead\trelation\ttail\trank"]
        for side in ("tail", "head"):
            for (h, r, t), rank in zip(triples.tolist(), ranks[side].tolist()):
                lines.append(f"{side}\t{h}\t{r}\t{t}\t{rank:g}")
        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
        return len(lines) - 1

    def ranking(self) -> tuple[ScoreFn, RankingScope | None]:
        """How evaluation scores queries against entity ids, and which entities it scores here."""
        return self.model.entity_scorer(), None

    def headline(self, metrics: dict[str, dict]) -> str:
        parts = []
        if "both" in metrics:
            both = metrics["both"]
            parts.append(
                f"MRR {both['mrr']:.4f}, Hits@1 {both['hits_at_1']:.4f}, Hits@10 {both['hits_at_10']:.4f}, MR {both['mr']:.1f}"
            )
        if "ogb" in metrics:
            ogb = metrics["ogb"]
            parts.append(f"OGB MRR {ogb['mrr']:.4f}, Hits@1 {ogb['hits_at_1']:.4f}, Hits@10 {ogb['hits_at_10']:.4f}")
        return "; ".join(parts)
