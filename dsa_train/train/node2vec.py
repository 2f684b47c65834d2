"""node2vec / DeepWalk as a training task: walks in, a node-embedding table out.

An epoch starts ``walks_per_node`` walks at every node; a batch is ``batch_size`` start nodes.
Each walk's windows of ``context_size`` nodes are positive pairs; for each, ``negatives``
windows of the start node followed by random nodes are negative pairs (PyG's Node2Vec
sampling, with the walks from :class:`~dsa_train.data.walks.WalkSampler`). Evaluation: the
logistic-regression probe where the graph has labels, link prediction where it has held-out
edges.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..data.graphs import Graph, load_graph
from ..data.walks import WalkSampler
from ..eval.node import link_prediction, probe_accuracy
from ..models.node import GRAM_LIMIT, SkipGram, windows
from ..recipe import Recipe
from .tasks import FLOAT_BYTES, TableSite, Working, check_sizes, disk_table, keys_of


def node2vec_working(recipe: Recipe, num_nodes: int) -> Working:
    """What a step holds at once (see :meth:`Node2VecTask.loss` and :meth:`SkipGram.loss`), from
    the recipe's sizes: the walks and their windows (int64, with ``torch.unique``'s copies),
    and, where the windows name more than 4,096 distinct nodes, the gathered
    ``windows x (context_size - 1) x dim`` rows, their product and gradients (measured: at
    most 3 copies; 3.5 counted)."""
    c, dim = recipe.model.node2vec, recipe.model.dim
    b = min(recipe.train.batch_size, max(num_nodes, 1))
    walks = b * c.walks_per_node
    per_walk = c.walk_length - c.context_size + 2  # windows of a walk of walk_length + 1 nodes
    count = walks * (1 + c.negatives) * per_walk  # positive and negative windows
    ids = count * c.context_size
    distinct = min(num_nodes, ids)
    pairs = count * (c.context_size - 1)
    if distinct * distinct <= GRAM_LIMIT:
        floats = distinct * distinct * 2 + 3 * pairs + 3 * distinct * dim
    else:
        floats = 7 * pairs * dim // 2 + 3 * pairs + 3 * distinct * dim
    step = 8 * (5 * ids + 3 * walks * (1 + c.negatives) * (c.walk_length + 1)) + FLOAT_BYTES * floats
    keys = keys_of(train__batch_size=recipe.train.batch_size) + (f" (at most {b:,} start nodes per step)" if b < recipe.train.batch_size else "")
    keys += ", " + keys_of(
        model__node2vec__walks_per_node=c.walks_per_node, model__node2vec__negatives=c.negatives,
        model__node2vec__walk_length=c.walk_length, model__node2vec__context_size=c.context_size, model__dim=dim,
    )  # fmt: skip
    return Working(
        f"one training step ({count:,} windows of {c.context_size} nodes)", step, keys,
        "lower train.batch_size (start nodes per step), model.node2vec.walks_per_node or model.node2vec.negatives, "
        "or model.dim: a step scores batch_size x walks_per_node x (1 + negatives) walks' windows",
    )  # fmt: skip


class Node2VecTask:
    unit = "nodes"

    def __init__(self, recipe: Recipe, device: torch.device, tables: TableSite | None = None) -> None:
        self.recipe, self.device = recipe, device
        self.config = recipe.model.node2vec
        self.graph: Graph = load_graph(recipe.dataset)
        self.description = str(self.graph)
        self.sampler = WalkSampler(self.graph.rowptr, self.graph.col, p=self.config.p, q=self.config.q)
        working = [node2vec_working(recipe, self.graph.num_nodes)]
        check_sizes(recipe, device, tables, table="nodes", rows=self.graph.num_nodes, other=0, working=working)
        nodes = disk_table(recipe, tables, "nodes", self.graph.num_nodes, std=SkipGram.INIT_STD)
        self.model = SkipGram(self.graph.num_nodes, recipe.model.dim, embedding=nodes).to(device)

    def prefetch(self, picked: Tensor) -> None:
        # The walks are drawn inside the step; their start nodes are known now.
        self.model.embedding.prefetch(picked)

    def sparse_parameters(self) -> list[tuple[str, Tensor]]:
        return list(self.model.named_parameters())

    def dense_parameters(self) -> list[Tensor]:
        return []

    def epoch_items(self) -> int:
        return self.graph.num_nodes

    def loss(self, picked: Tensor) -> Tensor:
        c = self.config
        positive = windows(self.sampler.walks(picked.repeat(c.walks_per_node), c.walk_length), c.context_size)
        starts = picked.repeat(c.walks_per_node * c.negatives)
        random_walks = torch.cat([starts[:, None], torch.randint(0, self.graph.num_nodes, (len(starts), c.walk_length))], 1)
        negative = windows(random_walks, c.context_size)
        return self.model.loss(positive.to(self.device), negative.to(self.device))

    def evaluate(self, split: str, *, final: bool, reporter) -> dict[str, dict]:
        return evaluate_node_embeddings(self.graph, self.model.node_embeddings().cpu(), split, self.recipe)

    def headline(self, metrics: dict[str, dict]) -> str:
        return headline(metrics)


#: The probe fits and scores at most this many nodes of each split (a seeded sample): on a
#: 10M-node graph the full split would need gigabytes of float64 features.
PROBE_NODES = 20_000


def evaluate_node_embeddings(graph: Graph, z: Tensor, split: str, recipe: Recipe) -> dict[str, dict]:
    """The probe (where there are labels) and link prediction (where edges are held out)."""
    metrics: dict[str, dict] = {}
    mask = graph.val_mask if split == "valid" else graph.test_mask
    if graph.labels is not None and graph.train_mask is not None and mask is not None and mask.any():
        train, scored = _sampled(graph.train_mask, recipe.train.seed), _sampled(mask, recipe.train.seed + 1)
        nodes = torch.cat([train.nonzero().squeeze(1), scored.nonzero().squeeze(1)]).unique()
        accuracy = probe_accuracy(z[nodes], graph.labels[nodes], train[nodes], {split: scored[nodes]})
        metrics["probe"] = {"accuracy": accuracy[split], "train_accuracy": accuracy["train"], "nodes": int(scored.sum())}
    edges = graph.valid_edges if split == "valid" else graph.test_edges
    if edges is not None and len(edges):
        score = lambda u, v: (z[u] * z[v]).sum(-1)  # noqa: E731
        metrics["link"] = link_prediction(score, edges, graph.num_nodes, negatives=recipe.eval.link_negatives, seed=recipe.train.seed)
    return metrics


def headline(metrics: dict[str, dict]) -> str:
    parts = []
    if "probe" in metrics:
        parts.append(f"accuracy {metrics['probe']['accuracy']:.4f}")
    if "link" in metrics:
        parts.append(f"AUC {metrics['link']['auc']:.4f}, MRR {metrics['link']['mrr']:.4f}")
    return ", ".join(parts) or "nothing to evaluate (no labels, no held-out edges)"


def _sampled(mask: Tensor, seed: int) -> Tensor:
    """The mask, thinned to at most PROBE_NODES nodes by a seeded sample."""
    chosen = mask.nonzero().squeeze(1)
    if len(chosen) <= PROBE_NODES:
        return mask
    keep = chosen[torch.randperm(len(chosen), generator=torch.Generator().manual_seed(seed))[:PROBE_NODES]]
    thinned = torch.zeros_like(mask)
    thinned[keep] = True
    return thinned
