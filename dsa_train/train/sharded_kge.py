r"""Knowledge-graph embedding with the entity table sharded by rows over the ranks of a
``torchrun`` job (see docs/distributed.md).

Every rank reads the whole global batch of triples (ids only: a few KiB) and draws the step's
negatives from the same seeded generator, so every rank knows every query and the shared
candidate set :math:`C` (the uniform negatives, plus the batch's answers with
``train.batch_negatives``). The batch is cut into ``distributed.slices`` slices of triples;
slice :math:`m` is computed by rank :math:`m \bmod W`:

1. the rank asks the owners for the rows its slices and :math:`C` need (one
   ``all_to_all_single`` of ids, one of rows);
2. per slice, it scores the slice's tail and head queries against :math:`C` and their own
   answers exactly as :class:`~dsa_train.train.kge.KGETask` does, with the slice's loss
   divided by the *global* number of queries (:math:`2n`), and runs backward on leaf copies
   of the rows, so each lookup's gradient row is that slice's alone;
3. every gradient row goes to its row's owner with its position in the global batch
   (slice, then lookup), and each owner sums a row's gradients in that order
   (:func:`~dsa_train.distributed.exchange.sum_in_batch_order`) and steps its optimizer;
   the relation table is replicated, its gradient rows gathered on every rank and summed the
   same way, and every copy takes the same SparseAdam step.

**Exactness.** A slice's computation depends on the slice and :math:`C` alone, never on which
rank runs it or how many there are (same tensors, same shapes, dropout masks seeded by the
step and the slice), and the owners' sums follow global-batch order. So after any number of
steps the tables, the moments and the losses are bit-equal for every :math:`W`, from one
process (``torchrun --nproc-per-node 1``) up to ``slices`` ranks. A single process run
without ``torchrun`` computes the batch in one piece (one slice) and gets the same results up to
float rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..data import load_knowledge_graph
from ..distributed.exchange import gather_everywhere, sum_in_batch_order
from ..distributed.group import World
from ..errors import DsaError
from ..eval.ranking import RankingScope, ScoreFn
from ..models import SCORING_FUNCTIONS
from ..models.dropout import seeded_mask
from ..recipe import Recipe
from .kge import KGETask, sampled_loss
from .shards import ShardedTask, sharded_layout, wait_for_import
from .tables import TableSite


class ShardedKGETask(ShardedTask, KGETask):
    """A :class:`KGETask` whose entity table is this rank's shard (see the module docstring)."""

    def __init__(self, recipe: Recipe, device: torch.device, world: World, tables: TableSite | None = None) -> None:
        if recipe.train.candidates == "all":
            raise DsaError(
                "train.candidates 'all' runs in one process so far: each rank would fetch every entity row every step",
                hint="set train.candidates: sampled for a torchrun job, or run without torchrun",
            )
        replicated = SCORING_FUNCTIONS.get(recipe.model.kind).replicated
        if replicated != ("rel_emb",):
            raise DsaError(
                f"model.kind {recipe.model.kind!r} keeps {', '.join(replicated)} on every rank; sharded training replicates only "
                "the relation table (rel_emb) so far",
                hint="run it in one process (without torchrun)",
            )
        wait_for_import(world, lambda: load_knowledge_graph(recipe.dataset))
        super().__init__(recipe, device, tables, layout=sharded_layout(world, recipe))
        self.world = world
        self.description += (
            f"; entities sharded over {world.world_size} ranks (this rank holds {self.shards.rows_here:,} rows)"
        )

    # -- one step ------------------------------------------------------------------------------
    def gradients(self, picked: Tensor) -> float:
        """Forward and backward of this rank's slices of the global batch ``picked``; leaves
        each table's summed sparse gradient in its ``.grad`` and returns the batch's loss."""
        cfg, model, shards = self.recipe.train, self.model, self.shards
        triples = self.kg.rows("train", picked)
        n = len(triples)
        negatives = torch.randint(0, self.kg.num_entities, (cfg.negatives,), device=self.device).cpu()
        mask_seed = int(torch.randint(0, 1 << 62, (1,)))  # the step's dropout seeds: the same on every rank
        anchors, answers = torch.cat([triples[:, 0], triples[:, 2]]), torch.cat([triples[:, 2], triples[:, 0]])
        relations = torch.cat([triples[:, 1], triples[:, 1]])
        candidates = torch.cat([answers, negatives]) if cfg.batch_negatives else negatives
        mine = shards.my_slices(n)
        queries = {m: torch.cat([torch.arange(a, b), n + torch.arange(a, b)]) for m, a, b in mine}
        wanted = [candidates] if mine else []
        for m, _, _ in mine:
            wanted += [anchors[queries[m]], answers[queries[m]]]
        ids = torch.cat(wanted) if wanted else torch.empty(0, dtype=torch.int64)
        rows = shards.fetch(ids, "fetching the step's entity rows")
        k, longest = len(candidates), 2 * (n // shards.slices + 1)
        span = k + 2 * longest  # positions of slice m: [m * span, (m + 1) * span)
        candidate_mask = self._dropout_mask((k, rows.shape[1]), mask_seed)
        found = {"ids": [], "grads": [], "positions": [], "rel_ids": [], "rel_grads": [], "rel_positions": []}
        losses = torch.zeros(shards.slices, dtype=torch.float64)
        start = k
        for m, _, _ in mine:
            q = queries[m]
            anchor_rows, answer_rows = rows[start : start + len(q)], rows[start + len(q) : start + 2 * len(q)]
            start += 2 * len(q)
            leaves = [r.to(self.device).requires_grad_() for r in (rows[:k], anchor_rows, answer_rows)]
            loss, rel_lookups, rel_leaf = self._slice_loss(
                leaves, candidate_mask, mask_seed + 1 + m, candidates, anchors[q], answers[q], relations[q], total=2 * n
            )
            loss.backward()
            losses[m] = loss.item()
            found["ids"] += [candidates, anchors[q], answers[q]]
            found["grads"] += [leaf.grad.cpu() for leaf in leaves]
            found["positions"].append(m * span + torch.arange(k + 2 * len(q)))
            found["rel_ids"].append(rel_lookups.cpu())
            found["rel_grads"].append(rel_leaf.grad.cpu())
            found["rel_positions"].append(m * longest + torch.arange(len(q)))
        cat = lambda key, like: torch.cat(found[key]) if found[key] else like  # noqa: E731
        no_rows, no_ids = torch.empty((0, rows.shape[1])), torch.empty(0, dtype=torch.int64)
        shards.push(cat("ids", no_ids), cat("grads", no_rows), cat("positions", no_ids))
        relation = model.rel_emb.weight
        with self.world.guard("gathering the relations' gradient rows"):
            rel_rows, rel_values = gather_everywhere(
                cat("rel_ids", no_ids), cat("rel_grads", no_rows), cat("rel_positions", no_ids), counter=shards.exchange
            )
        relation.grad = sum_in_batch_order(rel_rows, rel_values, tuple(relation.shape)).to(relation.device)
        return shards.total(losses)

    def _slice_loss(
        self,
        leaves: list[Tensor],
        candidate_mask: Tensor | None,
        seed: int,
        candidates: Tensor,
        anchors: Tensor,
        answers: Tensor,
        relations: Tensor,
        *,
        total: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One slice's share of the batch loss, from leaf copies of its rows: the shared
        candidates, the slice's anchors and answers (tail queries first, then head queries)."""
        cfg, model = self.recipe.train, self.model
        candidate_rows, anchor_rows, answer_rows = (model.constrain(leaf) for leaf in leaves)
        if candidate_mask is not None:
            candidate_rows = candidate_rows * candidate_mask.to(self.device)
            anchor_rows = anchor_rows * self._dropout_mask(tuple(anchor_rows.shape), seed).to(self.device)
            answer_rows = answer_rows * self._dropout_mask(tuple(answer_rows.shape), seed + (1 << 61)).to(self.device)
        half = len(anchors) // 2
        tail_rel, tail_side = model.relation_for(relations[:half].to(self.device), "tail")
        head_rel, head_side = model.relation_for(relations[half:].to(self.device), "head")
        rel_lookups = torch.cat([tail_rel, head_rel])
        rel_leaf = model.rel_emb.weight.detach()[rel_lookups].requires_grad_()
        rel_mask = self._dropout_mask(tuple(rel_leaf.shape), seed + (2 << 61), p=self.recipe.model.relation_dropout)
        rel_rows = rel_leaf if rel_mask is None else rel_leaf * rel_mask.to(self.device)
        masked = answers.to(self.device)[:, None] == candidates.to(self.device)[None, :]
        sides = [
            (anchor_rows[rows], rel_rows[rows], answer_rows[rows], side)
            for rows, side in ((slice(0, half), tail_side), (slice(half, None), head_side))
        ]
        loss = sampled_loss(model, cfg, sides, candidate_rows, masked, total=total)
        if cfg.regularization:  # N3 on the slice's embeddings, over the global batch
            loss = loss + cfg.regularization * model.n3(torch.cat([anchor_rows, answer_rows]), rel_leaf) / total
        return loss, rel_lookups, rel_leaf

    # -- evaluation ----------------------------------------------------------------------------
    def ranking(self) -> tuple[ScoreFn, RankingScope]:
        """Every rank scores the queries against the entities it holds; the answer's score
        and the rival counts are combined over ranks (:class:`ShardScope`)."""
        scope = ShardScope(self)

        def score(anchor: Tensor, relation: Tensor, candidates: Tensor, side: str, *, out=None) -> Tensor:
            _, local = self.shards.sharding.locate(candidates)
            rows = self.model.entities(local.to(self.model.node_emb.weight.device)).to(self.device)
            return self.model.score_candidates(
                scope.anchor_rows.to(self.device), relation.to(self.device), rows, side, out=out
            )

        return score, scope

    def _dropout_mask(self, shape: tuple[int, ...], seed: int, p: float | None = None) -> Tensor | None:
        """:func:`~dsa_train.models.dropout.seeded_mask` while training (``None`` without dropout);
        ``p`` defaults to the entity dropout."""
        p = self.recipe.model.dropout if p is None else p
        return seeded_mask(shape, p, seed) if p and self.model.training else None


class ShardScope(RankingScope):
    """A rank's share of a filtered ranking: the entities whose rows it holds."""

    def __init__(self, task: ShardedKGETask) -> None:
        shards = task.shards
        super().__init__(torch.sort(shards.sharding.ids_of(task.world.rank, torch.arange(shards.rows_here))).values)
        self.task = task
        self.anchor_rows: Tensor | None = None

    def prepare(self, anchor: Tensor) -> None:
        rows = self.task.shards.fetch(anchor.cpu(), "fetching the anchors of an evaluation batch", counted=False)
        self.anchor_rows = self.task.model.constrain(rows)

    def combine(self, partial: Tensor, op: str) -> Tensor:
        with self.task.world.guard("combining the evaluation's ranks"):
            dist.all_reduce(partial, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return partial
