"""Knowledge-graph embedding as a training task: triples in, filtered ranking metrics out.

A batch is positive triples; each asks its tail query (h, r, ?) and its head query
(?, r, t), scored against negatives shared by the step (uniform samples plus, by default,
the step's other answers), with the recipe's loss and optional N3 regularisation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..data import KnowledgeGraph, load_knowledge_graph
from ..eval import RankingMetrics, TripleIndex, evaluate_link_prediction
from ..models import KGEModel, build_kge_model
from ..models.losses import ranking_loss
from ..recipe import Recipe
from .tasks import TableSite, disk_table


class KGETask:
    unit = "triples"

    def __init__(self, recipe: Recipe, device: torch.device, tables: TableSite | None = None) -> None:
        self.recipe, self.device = recipe, device
        self.kg: KnowledgeGraph = load_knowledge_graph(recipe.dataset)
        self.description = str(self.kg)
        entities = disk_table(recipe, tables, "entities", self.kg.num_entities, std=recipe.model.init_std)
        self.model: KGEModel = build_kge_model(recipe.model, self.kg.num_entities, self.kg.num_relations, entities).to(device)
        self.index: TripleIndex | None = None

    def prefetch(self, picked: Tensor) -> None:
        self.model.node_emb.prefetch(self.kg.train[picked][:, [0, 2]].flatten())

    def sparse_parameters(self) -> list[tuple[str, Tensor]]:
        return list(self.model.named_parameters())

    def dense_parameters(self) -> list[Tensor]:
        return []

    def epoch_items(self) -> int:
        return len(self.kg.train)

    def loss(self, picked: Tensor) -> Tensor:
        cfg, model = self.recipe.train, self.model
        triples = self.kg.train[picked].to(self.device)
        heads, relations, tails = triples[:, 0], triples[:, 1], triples[:, 2]
        negatives = torch.randint(0, self.kg.num_entities, (cfg.negatives,), device=self.device)
        # Every triple asks its tail query (h, r, ?) and its head query (?, r, t).
        anchors, answers = torch.cat([heads, tails]), torch.cat([tails, heads])
        relations = torch.cat([relations, relations])
        n = len(triples)
        embedded = model.embed(torch.cat([anchors, answers, negatives]))
        anchor_emb, answer_emb, negative_emb = embedded[: 2 * n], embedded[2 * n : 4 * n], embedded[4 * n :]
        if cfg.batch_negatives:  # the other queries' answers: negatives drawn by popularity
            negatives, negative_emb = torch.cat([answers, negatives]), torch.cat([answer_emb, negative_emb])
        positive, negative = [], []
        for side, rows in (("tail", slice(0, n)), ("head", slice(n, 2 * n))):
            positive.append(model.score_answers(anchor_emb[rows], relations[rows], answer_emb[rows], side))
            negative.append(model.score_candidates(anchor_emb[rows], relations[rows], negative_emb, side))
        masked = answers[:, None] == negatives[None, :]  # a negative that is the query's own answer
        loss = ranking_loss(cfg.loss, torch.cat(positive), torch.cat(negative), masked, margin=cfg.margin)
        if cfg.regularization:  # N3 (Lacroix et al., 2018) on the step's embeddings
            rel_rows = torch.cat([model.relation_for(relations[:n], "tail")[0], model.relation_for(relations[n:], "head")[0]])
            used = (anchor_emb, answer_emb, model.rel_emb(rel_rows))
            loss = loss + cfg.regularization * sum(e.abs().pow(3).sum() for e in used) / (2 * n)
        return loss

    def evaluate(self, split: str, *, final: bool, reporter) -> dict[str, dict]:
        """Filtered ranking of a split; during training at most ``eval.max_queries`` triples."""
        cfg = self.recipe.eval
        if self.index is None:  # every true triple of every split: what filtered ranking filters out
            kg = self.kg
            self.index = TripleIndex(torch.cat([kg.train, kg.valid, kg.test]), kg.num_entities, kg.num_relations)
        triples = self.kg.split(split)
        limit = None if final else cfg.max_queries
        if limit is not None and len(triples) > limit:
            pick = torch.randperm(len(triples), generator=torch.Generator().manual_seed(self.recipe.train.seed))
            triples = triples[pick[:limit]]
        reporter.eval_start(split, 2 * len(triples))
        metrics: dict[str, RankingMetrics] = evaluate_link_prediction(
            self.model.score_entities,
            triples,
            self.index,
            num_entities=self.kg.num_entities,
            batch_size=cfg.batch_size,
            entity_chunk=cfg.entity_chunk,
            sampled_negatives=cfg.sampled_negatives,
            seed=self.recipe.train.seed,
            progress=reporter.eval_advance,
        )
        return {side: m.as_dict() for side, m in metrics.items()}

    def headline(self, metrics: dict[str, dict]) -> str:
        both = metrics["both"]
        return f"MRR {both['mrr']:.4f}, Hits@1 {both['hits_at_1']:.4f}, Hits@10 {both['hits_at_10']:.4f}, MR {both['mr']:.1f}"
