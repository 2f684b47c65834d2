"""GraphSAGE over learnable node embeddings as a training task.

``task: link``: a batch is training edges (u, v), each with a random pair (u, w); the seeds
u, v, w are encoded on a sampled neighbourhood and the logistic loss pushes edges up and
random pairs down. ``task: node``: a batch is labelled training nodes, classified by a linear
head on their encodings. Only the sampled nodes' embedding rows are looked up, so a step is
sparse; the SAGE layers and the head are dense and train with torch's Adam. Evaluation
encodes every node on the whole training graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..data import Graph, load_graph
from ..errors import ConfigError
from ..data.neighbors import NeighbourSampler
from ..models.node import SageOverEmbeddings
from ..recipe import Recipe
from .sizes import FLOAT_BYTES, Working, check_sizes, keys_of
from .tables import TableSite, disk_table
from .task import Task
from .node2vec import evaluate_node_embeddings, headline


def sage_working(recipe: Recipe, num_nodes: int, num_edges: int, items: int) -> list[Working]:
    """What a step (a sampled neighbourhood, with gradients) and an evaluation (every node
    encoded on the whole graph, see :meth:`SageTask.encode_all`) hold at once, from the
    recipe's sizes. A sampled subgraph is bounded by the full fanout tree and by the graph;
    the messages of an edge are ``max(dim, hidden)`` floats."""
    c, dim, b = recipe.model.sage, recipe.model.dim, min(recipe.train.batch_size, max(items, 1))
    width = max(dim, c.hidden)
    seeds = b if c.task == "node" else 3 * b
    tree_nodes, tree_edges, level = 1, 0, 1
    for fanout in c.fanout:
        level *= fanout
        tree_nodes, tree_edges = tree_nodes + level, tree_edges + level
    sub_nodes, sub_edges = min(num_nodes, seeds * tree_nodes), min(num_edges, seeds * tree_edges)
    # The fanout tree overestimates a real sample several times over (measured: 6 to 8), so the
    # activations and messages are counted once, without their gradients.
    step = FLOAT_BYTES * (sub_nodes * (dim + c.hidden * c.layers) + sub_edges * width) + 24 * sub_edges
    whole = FLOAT_BYTES * (3 * num_edges * width // 2 + 2 * num_nodes * (dim + 2 * c.hidden)) + 32 * num_edges
    shape = keys_of(model__dim=dim, model__sage__hidden=c.hidden)
    return [
        Working(
            f"one training step (up to {sub_nodes:,} sampled nodes, {sub_edges:,} edges)",
            step,
            f"{keys_of(train__batch_size=recipe.train.batch_size)}, model.sage.fanout={c.fanout}, {shape}",
            "lower train.batch_size, model.sage.fanout, model.dim or model.sage.hidden",
        ),
        Working(
            f"encoding the whole graph for evaluation ({num_nodes:,} nodes, {num_edges:,} edges)",
            whole,
            shape,
            "lower model.dim or model.sage.hidden: evaluation encodes every node of the graph at once",
        ),
    ]


class SageTask(Task):
    def __init__(self, recipe: Recipe, device: torch.device, tables: TableSite | None = None) -> None:
        self.recipe, self.device = recipe, device
        self.config = recipe.model.sage
        self.graph: Graph = load_graph(recipe.dataset)
        self.description = str(self.graph)
        node_task = self.config.task == "node"
        if node_task and (self.graph.labels is None or not len(self.graph.nodes("train"))):
            raise ConfigError(["model.sage.task: 'node' needs a dataset with labels and training nodes"])
        self.unit = "nodes" if node_task else "edges"
        # The link task's items: every training edge once (u < v), 2 ids each, built once.
        self.train_edges = self.graph.upper_edges() if not node_task else None
        self.train_nodes = self.graph.nodes("train") if node_task else None
        self.sampler = NeighbourSampler(self.graph.rowptr, self.graph.col, self.config.fanout)
        c, dim, num_classes = self.config, recipe.model.dim, self.graph.num_classes if node_task else 0
        encoder = (
            2 * (dim * c.hidden + (c.layers - 1) * c.hidden * c.hidden)
            + (c.layers + 1) * c.hidden
            + (c.hidden + 1) * num_classes
        )
        check_sizes(
            recipe,
            device,
            tables,
            table="nodes",
            rows=self.graph.num_nodes,
            other=4 * encoder * FLOAT_BYTES,
            other_keys=keys_of(model__sage__hidden=c.hidden),
            other_what="the SAGE layers (weights, gradients and Adam's moments)",
            working=sage_working(
                recipe,
                self.graph.num_nodes,
                len(self.graph.col),
                len(self.train_nodes if node_task else self.train_edges),
            ),
        )
        nodes = disk_table(recipe, tables, "nodes", self.graph.num_nodes, std=SageOverEmbeddings.INIT_STD)
        self.model = SageOverEmbeddings(
            self.graph.num_nodes,
            recipe.model.dim,
            self.config.hidden,
            self.config.layers,
            dropout=self.config.dropout,
            num_classes=self.graph.num_classes if node_task else 0,
            embedding=nodes,
        ).to(device)

    def prefetch(self, picked: Tensor) -> None:
        # The seeds are known now; their sampled neighbours only inside the step.
        seeds = self.train_nodes[picked] if self.train_nodes is not None else self.train_edges[picked].flatten()
        self.model.embedding.prefetch(seeds.long())

    def sparse_parameters(self) -> list[tuple[str, Tensor]]:
        return [("embedding.weight", self.model.embedding.weight)]

    def dense_parameters(self) -> list[Tensor]:
        return [p for name, p in self.model.named_parameters() if not name.startswith("embedding.")]

    def epoch_items(self) -> int:
        return len(self.train_nodes) if self.train_nodes is not None else len(self.train_edges)

    def _encode(self, seeds: Tensor) -> Tensor:
        """Encodings of the (unique, sorted) seeds on a sampled neighbourhood."""
        n_id, edge_index = self.sampler.sample(seeds)
        return self.model.encode(n_id.to(self.device), edge_index.to(self.device))[: len(seeds)]

    def loss(self, picked: Tensor) -> Tensor:
        if self.train_nodes is not None:
            seeds = torch.unique(self.train_nodes[picked].long())
            return self.model.node_loss(self._encode(seeds), self.graph.labels[seeds].long().to(self.device))
        edges = self.train_edges[picked].long()
        random_pairs = torch.stack([edges[:, 0], torch.randint(0, self.graph.num_nodes, (len(edges),))], 1)
        seeds = torch.unique(torch.cat([edges.reshape(-1), random_pairs[:, 1]]))
        z = self._encode(seeds)
        local = lambda pairs: torch.searchsorted(seeds, pairs).to(self.device)  # noqa: E731
        return self.model.link_loss(z, local(edges), local(random_pairs))

    @torch.no_grad()
    def encode_all(self) -> Tensor:
        """Every node's encoding on the whole training graph (full-batch message passing: it
        holds the graph's edge index, O(E), for the evaluation's duration)."""
        g = self.graph
        rows = torch.repeat_interleave(torch.arange(g.num_nodes), g.rowptr[1:] - g.rowptr[:-1])
        edge_index = torch.stack([g.col.long(), rows]).to(self.device)  # neighbour -> node
        # Every node's row through the table's forward, so it arrives on the encoder's device
        # whatever holds it: an nn.Embedding there, a DiskEmbedding's file on the host, a
        # checkpoint's table read through its deltas.
        return self.model.encoder(self.model.embedding(torch.arange(g.num_nodes, device=self.device)), edge_index)

    def evaluate(self, split: str, *, final: bool) -> dict[str, dict]:
        z = self.encode_all()
        if self.train_nodes is None:
            return evaluate_node_embeddings(self.graph, z.cpu(), split, self.recipe)
        nodes, train = self.graph.nodes(split).long(), self.train_nodes.long()
        if not len(nodes):
            return {}
        predicted = self.model.head(z).argmax(1).cpu()
        labels = self.graph.labels
        return {
            "classifier": {
                "accuracy": float((predicted[nodes] == labels[nodes].long()).double().mean()),
                "train_accuracy": float((predicted[train] == labels[train].long()).double().mean()),
                "nodes": len(nodes),
            }
        }

    def headline(self, metrics: dict[str, dict]) -> str:
        if "classifier" in metrics:
            return f"accuracy {metrics['classifier']['accuracy']:.4f}"
        return headline(metrics)
