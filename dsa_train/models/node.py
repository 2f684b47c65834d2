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


def distinct_nodes(positive: Tensor, negative: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct nodes of the windows (sorted), and the windows as positions among them."""
    nodes, local = torch.unique(torch.cat([positive.reshape(-1), negative.reshape(-1)]), return_inverse=True)
    split = positive.numel()
    return nodes, local[:split].view(positive.shape), local[split:].view(negative.shape)


class SkipGram(nn.Module):
    """``embedding``: a ready table (a DiskEmbedding) instead of a new in-memory one."""

    INIT_STD = 1.0  # N(0, 1), as PyG's Node2Vec

    def __init__(self, num_nodes: int, dim: int, *, embedding: nn.Module | None = None) -> None:
        super().__init__()
        self.embedding = embedding if embedding is not None else nn.Embedding(num_nodes, dim, sparse=True)

    def loss(self, positive: Tensor, negative: Tensor) -> Tensor:
        """``positive``/``negative``: windows whose first node is paired with each of the others.

        A batch's windows name a few hundred thousand nodes but only a few thousand distinct
        ones: each distinct row is looked up once and the windows index into those rows, so
        the sparse gradient has one row per distinct node instead of one per mention.
        """
        nodes, positive, negative = distinct_nodes(positive, negative)
        return self.rows_loss(self.embedding(nodes), positive, negative)

    @staticmethod
    def rows_loss(table: Tensor, positive: Tensor, negative: Tensor, totals: tuple[int, int] | None = None) -> Tensor:
        """The loss of windows given as rows of ``table`` (see :func:`distinct_nodes`);
        ``totals``: the batch's numbers of positive and negative pairs, when these windows are
        one slice of it (each part is then summed over its total instead of averaged)."""
        if len(table) ** 2 <= GRAM_LIMIT:
            # Few distinct nodes: all their dot products in one matrix product, then read the
            # pairs out of it (3x faster than gathering a (windows, context, dim) tensor).
            gram = table @ table.T
            scores = lambda w: gram[w[:, :1], w[:, 1:]]  # noqa: E731
        else:
            scores = lambda w: (rows(table, w[:, :1]) * rows(table, w[:, 1:])).sum(dim=-1)  # noqa: E731
        totals = totals or (None, None)
        return _logistic(scores(positive), True, totals[0]) + _logistic(scores(negative), False, totals[1])

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
