r"""Node-embedding models: one learnable row per node, in a sparse table.

* :class:`SkipGram` (DeepWalk, Perozzi et al. 2014; node2vec, Grover & Leskovec 2016), the
  objective of PyG's ``Node2Vec``: for a node :math:`u` and a node :math:`v` in the same walk
  window, and a random node :math:`w`,

  .. math::
      \mathcal{L} = -\log \sigma(\mathbf{z}_u^\top \mathbf{z}_v) - \log \sigma(-\mathbf{z}_u^\top \mathbf{z}_w)

  averaged over the positive and the negative pairs. PyG's class needs pyg-lib or
  torch-cluster for its walks; this one takes walks from :class:`~dsa_train.data.walks.WalkSampler`.

* :class:`SageOverEmbeddings` (GraphSAGE, Hamilton et al. 2017): PyG's ``GraphSAGE`` encoder
  whose input features are the sparse embedding rows of the sampled nodes, so a step touches
  only those rows; the encoder's own weights are dense. A link is scored by the dot product of
  its ends' encodings; a node is classified by a linear head on its encoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GraphSAGE

from ..nn import ChainEmbedding

EPS = 1e-15  # as PyG's Node2Vec: keeps log() finite


#: Largest number of (distinct node) pairs for which SkipGram forms the whole Gram matrix.
GRAM_LIMIT = 4096**2
#: :func:`distinct_nodes` marks nodes in a mask where the graph has at most this many nodes per
#: mention in the windows (the mask and its positions cost 9 bytes a node).
MARK_RATIO = 4


def _logistic(score: Tensor, positive: bool, total: int | None = None) -> Tensor:
    """The mean logistic loss of the pairs' scores (given ``total``: their sum over ``total``,
    one slice's share of a batch of ``total`` pairs)."""
    losses = -torch.log(torch.sigmoid(score if positive else -score) + EPS)
    return losses.mean() if total is None else losses.sum() / total


def rows(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for an index tensor of any shape, with a backward pass that adds in
    a fixed order. Indexing (``table[index]``) backpropagates through ``index_put_`` with
    accumulation, which on a CPU with several threads adds repeated rows with atomics in
    whatever order the threads reach them: the same seed then gives gradients (and after a
    few hundred steps, metrics) that differ from run to run. ``index_select``'s backward,
    ``index_add_``, adds in index order."""
    return table.index_select(0, index.reshape(-1)).view(*index.shape, *table.shape[1:])


def windows(walks: Tensor, context_size: int) -> Tensor:
    """All ``context_size``-node windows of each walk, as rows."""
    count = walks.shape[1] - context_size + 1
    return torch.cat([walks[:, j : j + context_size] for j in range(count)])


def distinct_nodes(positive: Tensor, negative: Tensor, num_nodes: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct nodes of the windows (sorted), and the windows as positions among them.

    Where the graph is small beside the windows (``num_nodes`` at most :data:`MARK_RATIO` times
    their mentions), the nodes are marked in a ``num_nodes``-long mask instead of sorted:
    the same result, about 7x faster on Cora's batches (no sort of the mentions)."""
    ids = torch.cat([positive.reshape(-1), negative.reshape(-1)])
    if num_nodes is not None and num_nodes <= MARK_RATIO * len(ids):
        seen = torch.zeros(num_nodes, dtype=torch.bool)
        seen[ids] = True
        nodes = seen.nonzero().squeeze(1)
        position = torch.empty(num_nodes, dtype=torch.int64)
        position[nodes] = torch.arange(len(nodes))
        local = position[ids]
    else:
        nodes, local = torch.unique(ids, return_inverse=True)
    split = positive.numel()
    return nodes, local[:split].view(positive.shape), local[split:].view(negative.shape)


class SkipGram(nn.Module):
    """``embedding``: a ready table (a DiskEmbedding) instead of a new in-memory one drawn from
    N(0, init_std^2). PyG's ``Node2Vec`` starts at N(0, 1); word2vec (and gensim) at a spread of
    about 0.5 / dim, from which one epoch learns what N(0, 1) needs dozens of epochs for
    (docs/results.md, node embeddings)."""

    INIT_STD = 1.0  # N(0, 1), as PyG's Node2Vec

    def __init__(
        self, num_nodes: int, dim: int, *, init_std: float = INIT_STD, embedding: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.num_nodes = num_nodes
        if embedding is None:  # (normal_ draws what nn.Embedding's own N(0, 1) start draws, scaled)
            embedding = nn.Embedding(
                num_nodes, dim, sparse=True, _weight=torch.empty(num_nodes, dim).normal_(0, init_std)
            )
        self.embedding = embedding

    def loss(self, positive: Tensor, negative: Tensor) -> Tensor:
        """``positive``/``negative``: windows whose first node is paired with each of the others.

        A batch's windows name a few hundred thousand nodes but only a few thousand distinct
        ones: each distinct row is looked up once and the windows index into those rows, so
        the sparse gradient has one row per distinct node instead of one per mention.
        """
        nodes, positive, negative = distinct_nodes(positive, negative, self.num_nodes)
        return self.rows_loss(self.embedding(nodes), positive, negative)

    @staticmethod
    def rows_loss(table: Tensor, positive: Tensor, negative: Tensor, totals: tuple[int, int] | None = None) -> Tensor:
        """The loss of windows given as rows of ``table`` (see :func:`distinct_nodes`);
        ``totals``: the batch's numbers of positive and negative pairs, when these windows are
        one slice of it (each part is then summed over its total instead of averaged)."""
        totals = totals or (None, None)
        if len(table) ** 2 > GRAM_LIMIT:
            scores = lambda w: (rows(table, w[:, :1]) * rows(table, w[:, 1:])).sum(dim=-1)  # noqa: E731
            return _logistic(scores(positive), True, totals[0]) + _logistic(scores(negative), False, totals[1])
        # Few distinct nodes: all their dot products in one matrix product, then the pairs read
        # out of it at flat positions, positive and negative at once (one index_select, whose
        # backward adds into one zeroed Gram gradient in index order).
        gram = (table @ table.T).view(-1)
        flat = lambda w: (w[:, :1] * len(table) + w[:, 1:]).reshape(-1)  # noqa: E731
        positive, negative = flat(positive), flat(negative)
        scores = gram.index_select(0, torch.cat([positive, negative]))
        split = len(positive)
        return _logistic(scores[:split], True, totals[0]) + _logistic(scores[split:], False, totals[1])

    def node_embeddings(self) -> Tensor:
        """Every node's embedding, indexable by node ids: the weight (a view of the table file
        for a DiskEmbedding), or a checkpoint's table read row by row when indexed."""
        if isinstance(self.embedding, ChainEmbedding):
            return self.embedding.rows
        return self.embedding.weight.detach()


class SageOverEmbeddings(nn.Module):
    """``embedding``: a ready table (a DiskEmbedding) instead of a new in-memory one."""

    INIT_STD = 0.1

    def __init__(
        self,
        num_nodes: int,
        dim: int,
        hidden: int,
        layers: int,
        *,
        dropout: float = 0.0,
        num_classes: int = 0,
        embedding: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if embedding is None:
            embedding = nn.Embedding(num_nodes, dim, sparse=True)
            nn.init.normal_(embedding.weight, std=self.INIT_STD)
        self.embedding = embedding
        self.encoder = GraphSAGE(dim, hidden, num_layers=layers, dropout=dropout)
        self.head = nn.Linear(hidden, num_classes) if num_classes else None

    def encode(self, nodes: Tensor, edge_index: Tensor) -> Tensor:
        """Encodings of ``nodes`` (global ids) on the subgraph ``edge_index`` (local ids)."""
        return self.encoder(self.embedding(nodes), edge_index)

    def link_loss(self, z: Tensor, positive: Tensor, negative: Tensor) -> Tensor:
        """Logistic loss of ``(E, 2)`` local-id pairs: true edges up, random pairs down."""
        pos = (rows(z, positive[:, 0]) * rows(z, positive[:, 1])).sum(-1)
        neg = (rows(z, negative[:, 0]) * rows(z, negative[:, 1])).sum(-1)
        return F.binary_cross_entropy_with_logits(
            torch.cat([pos, neg]), torch.cat([torch.ones_like(pos), torch.zeros_like(neg)])
        )

    def node_loss(self, z: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(self.head(z), labels)
