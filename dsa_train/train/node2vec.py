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

from ..data import Graph, load_graph
from ..data.order import Shuffle
from ..data.walks import WalkSampler
from ..eval.node import link_prediction, probe_accuracy
from ..models.node import GRAM_LIMIT, SkipGram, windows
from ..recipe import Recipe
from .sizes import FLOAT_BYTES, Working, check_sizes, keys_of
from .tables import TableSite, WholeTable
from .task import Task


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
    keys = keys_of(train__batch_size=recipe.train.batch_size) + (
        f" (at most {b:,} start nodes per step)" if b < recipe.train.batch_size else ""
    )
    keys += ", " + keys_of(
        model__node2vec__walks_per_node=c.walks_per_node,
        model__node2vec__negatives=c.negatives,
        model__node2vec__walk_length=c.walk_length,
        model__node2vec__context_size=c.context_size,
        model__dim=dim,
    )
    return Working(
        f"one training step ({count:,} windows of {c.context_size} nodes)",
        step,
        keys,
        "lower train.batch_size (start nodes per step), model.node2vec.walks_per_node or model.node2vec.negatives, "
        "or model.dim: a step scores batch_size x walks_per_node x (1 + negatives) walks' windows",
    )


class Node2VecTask(Task):
    unit = "nodes"

    def __init__(
        self, recipe: Recipe, device: torch.device, tables: TableSite | None = None, *, layout=WholeTable
    ) -> None:
        """``layout(num_nodes)``: where this process's node rows are (:class:`~.tables.WholeTable`)."""
        self.recipe, self.device = recipe, device
        self.config = recipe.model.node2vec
        self.graph: Graph = load_graph(recipe.dataset)
        self.description = str(self.graph)
        g = self.graph
        self.layout = layout(g.num_nodes)
        self.sampler = WalkSampler(g.rowptr, g.col, p=self.config.p, q=self.config.q, max_degree=g.max_degree)
        working = [node2vec_working(recipe, self.graph.num_nodes)]
        check_sizes(recipe, device, tables, table="nodes", rows=self.layout.rows_here, other=0, working=working)
        table = self.layout.make_table(recipe, tables, "nodes", std=self.config.init_std)
        self.model = SkipGram(g.num_nodes, recipe.model.dim, init_std=self.config.init_std, embedding=table).to(device)

    def prefetch(self, picked: Tensor) -> None:
        # The walks are drawn inside the step; their start nodes are known now.
        self.model.embedding.prefetch(picked)

    def sparse_parameters(self) -> list[tuple[str, Tensor]]:
        return list(self.model.named_parameters())

    def epoch_items(self) -> int:
        return self.graph.num_nodes

    def loss(self, picked: Tensor) -> Tensor:
        positive, negative = self.windows(picked)
        return self.model.loss(positive.to(self.device), negative.to(self.device))

    def windows(self, picked: Tensor) -> tuple[Tensor, Tensor]:
        """The positive windows of walks from the start nodes ``picked`` and the negative
        windows (each start node followed by random nodes), drawn from torch's generator."""
        c = self.config
        positive = windows(self.sampler.walks(picked.repeat(c.walks_per_node), c.walk_length), c.context_size)
        starts = picked.repeat(c.walks_per_node * c.negatives)
        random_walks = torch.cat(
            [starts[:, None], torch.randint(0, self.graph.num_nodes, (len(starts), c.walk_length))], 1
        )
        return positive, windows(random_walks, c.context_size)

    def evaluate(self, split: str, *, final: bool) -> dict[str, dict]:
        return evaluate_node_embeddings(self.graph, self.model.node_embeddings().cpu(), split, self.recipe)

    def headline(self, metrics: dict[str, dict]) -> str:
        return headline(metrics)


#: The probe fits and scores at most this many nodes of each split (a seeded sample): on a
#: 10^8-node graph the full split would need gigabytes of float64 features.
PROBE_NODES = 20_000
#: Link prediction scores at most this many held-out edges (a seeded sample).
LINK_EDGES = 50_000


def evaluate_node_embeddings(graph: Graph, z: Tensor, split: str, recipe: Recipe) -> dict[str, dict]:
    """The probe (where there are labels) and link prediction (where edges are held out).

    Both run on bounded, seeded samples: the probe learns from at most :data:`PROBE_NODES`
    training nodes and scores at most as many of the split's nodes (``nodes`` of
    ``split_nodes`` in the result), link prediction scores at most :data:`LINK_EDGES` edges
    (``edges`` of ``split_edges``). Smaller splits are used whole. ``z`` is read only at
    the rows sampled (it may be a memory-mapped table)."""
    metrics: dict[str, dict] = {}
    scored_split = graph.nodes(split)
    if graph.labels is not None and len(graph.nodes("train")) and len(scored_split):
        train, scored = _sampled(graph.nodes("train"), recipe.train.seed), _sampled(scored_split, recipe.train.seed + 1)
        nodes = torch.cat([train, scored]).unique()
        accuracy = probe_accuracy(
            z[nodes], graph.labels[nodes].long(), torch.isin(nodes, train), {split: torch.isin(nodes, scored)}
        )
        metrics["probe"] = {
            "accuracy": accuracy[split],
            "train_accuracy": accuracy["train"],
            "nodes": len(scored),
            "split_nodes": len(scored_split),
        }
    edges = graph.valid_edges if split == "valid" else graph.test_edges
    if edges is not None and len(edges):
        picked = _positions(len(edges), recipe.train.seed + 2, LINK_EDGES)
        score = lambda u, v: (z[u] * z[v]).sum(-1)  # noqa: E731
        link = link_prediction(
            score, edges[picked].long(), graph.num_nodes, negatives=recipe.eval.link_negatives, seed=recipe.train.seed
        )
        metrics["link"] = {**link, "split_edges": len(edges)}
    return metrics


def headline(metrics: dict[str, dict]) -> str:
    parts = []
    if "probe" in metrics:
        parts.append(f"accuracy {metrics['probe']['accuracy']:.4f}")
    if "link" in metrics:
        parts.append(f"AUC {metrics['link']['auc']:.4f}, MRR {metrics['link']['mrr']:.4f}")
    return ", ".join(parts) or (
        "nothing to evaluate (no labels, no held-out edges): dataset.link_split: [0.0, 0.05] holds out 5% of the edges for link prediction"
    )


def _positions(count: int, seed: int, limit: int) -> Tensor:
    """At most ``limit`` of the positions ``0 .. count - 1``, ascending: all of them, or a
    seeded uniform sample without replacement (the first ``limit`` of a :class:`Shuffle`,
    so no ``count``-long permutation is made)."""
    if count <= limit:
        return torch.arange(count)
    return Shuffle(count, seed).slice(0, limit).sort().values


def _sampled(nodes: Tensor, seed: int) -> Tensor:
    """At most :data:`PROBE_NODES` of these (ascending) node ids, as int64."""
    return nodes[_positions(len(nodes), seed, PROBE_NODES)].long()
