r"""TransE and DistMult with sparse entity and relation embeddings.

Both build on PyG's :class:`torch_geometric.nn.kge.KGEModel` (its ``node_emb`` and
``rel_emb`` tables with ``sparse=True``, its per-triple ``forward``). What PyG lacks, and this
module adds: scoring one query against a *set* of candidate entities at once (shared
negatives in training, all entities in evaluation), reciprocal relations, and the
initialisation and dropout the training recipes use.

With ``reciprocal=True`` the relation table has :math:`2|R|` rows: relation :math:`r + |R|`
is the inverse of :math:`r`, and a head query :math:`(?, r, t)` is asked as the tail query
:math:`(t, r + |R|, ?)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch_geometric.nn.kge
from torch import Tensor

from ..recipe import ModelConfig


class KGEModel(torch_geometric.nn.kge.KGEModel):
    """Entity and relation tables plus a score :math:`f(h, r, t)` (higher: more plausible)."""

    def __init__(
        self,
        num_entities: int,
        num_relations: int,
        dim: int,
        *,
        reciprocal: bool = True,
        init_std: float = 1e-3,
        dropout: float = 0.0,
        entity_table: torch.nn.Module | None = None,
    ) -> None:
        self.num_base_relations = num_relations
        self.reciprocal = reciprocal
        self.init_std = init_std
        self.dropout = dropout
        relations = 2 * num_relations if reciprocal else num_relations
        # With an entity table given (a DiskEmbedding, already initialised), PyG's own N x D
        # node table must never be allocated: build with one node, then swap the table in.
        self.given_entities = entity_table is not None  # initialised by whoever made it
        super().__init__(1 if entity_table is not None else num_entities, relations, dim, sparse=True)
        if entity_table is not None:
            self.num_nodes, self.node_emb = num_entities, entity_table
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.given_entities:
            torch.nn.init.normal_(self.node_emb.weight, std=self.init_std)
        torch.nn.init.normal_(self.rel_emb.weight, std=self.init_std)

    def forward(self, head_index: Tensor, rel_type: Tensor, tail_index: Tensor) -> Tensor:
        """Scores of the triples ``(head_index[i], rel_type[i], tail_index[i])``."""
        return self.score_pairs(self.node_emb(head_index), self.rel_emb(rel_type), self.node_emb(tail_index))

    def relation_for(self, relation: Tensor, side: str) -> tuple[Tensor, str]:
        """The relation rows and the side to score, with a head query turned around if reciprocal."""
        if self.reciprocal and side == "head":
            return relation + self.num_base_relations, "tail"
        return relation, side

    def score_candidates(self, anchor: Tensor, relation: Tensor, candidates: Tensor, side: str) -> Tensor:
        """``(B, K)`` scores of ``B`` queries against ``K`` candidate embeddings.

        ``anchor`` are the known entities' embeddings ``(B, D)``; ``relation`` the relation
        ids ``(B,)``; ``side`` says which end the candidates fill ("tail" or "head").
        """
        rows, side = self.relation_for(relation, side)
        return self.score_sets(anchor, self.rel_emb(rows), candidates, side)

    def score_entities(self, anchor: Tensor, relation: Tensor, candidates: Tensor, side: str) -> Tensor:
        """``(B, K)`` scores of queries given by ids against candidate entity ids (evaluation)."""
        device = self.rel_emb.weight.device
        return self.score_candidates(self.node_emb(anchor.to(device)), relation.to(device), self.node_emb(candidates.to(device)), side)

    def score_answers(self, anchor: Tensor, relation: Tensor, answer: Tensor, side: str) -> Tensor:
        """``(B,)`` scores of each query's own answer embedding ``answer[i]``."""
        rows, side = self.relation_for(relation, side)
        rel = self.rel_emb(rows)
        return self.score_pairs(anchor, rel, answer) if side == "tail" else self.score_pairs(answer, rel, anchor)

    def embed(self, entities: Tensor) -> Tensor:
        """Entity embeddings, with dropout while training."""
        return F.dropout(self.node_emb(entities), self.dropout, self.training)

    def score_pairs(self, head: Tensor, rel: Tensor, tail: Tensor) -> Tensor:
        raise NotImplementedError

    def score_sets(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str) -> Tensor:
        raise NotImplementedError


class TransE(KGEModel):
    r"""TransE (Bordes et al., NeurIPS 2013): relations translate heads onto tails.

    .. math::
        f(h, r, t) = -\lVert \mathbf{e}_h + \mathbf{r}_r - \mathbf{e}_t \rVert_p

    Against many candidates, :math:`p = 2` uses
    :math:`\lVert q - e \rVert^2 = \lVert q \rVert^2 - 2\, q \cdot e + \lVert e \rVert^2` (one
    matrix product); :math:`p = 1` uses ``torch.cdist``.
    """

    def __init__(self, *args, p_norm: int = 2, **kwargs) -> None:
        self.p_norm = p_norm
        super().__init__(*args, **kwargs)

    def score_pairs(self, head: Tensor, rel: Tensor, tail: Tensor) -> Tensor:
        return -(head + rel - tail).norm(p=self.p_norm, dim=-1)

    def score_sets(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str) -> Tensor:
        # tail side: -||(h + r) - e||;  head side: -||e + r - t|| = -||(t - r) - e||
        query = anchor + rel if side == "tail" else anchor - rel
        if self.p_norm == 1:
            return -torch.cdist(query, candidates, p=1)
        squared = (query * query).sum(1, keepdim=True) - 2 * query @ candidates.T + (candidates * candidates).sum(1)
        return -squared.clamp_min(1e-12).sqrt()


class DistMult(KGEModel):
    r"""DistMult (Yang et al., ICLR 2015): a diagonal bilinear score.

    .. math::
        f(h, r, t) = \langle \mathbf{e}_h, \mathbf{r}_r, \mathbf{e}_t \rangle
                   = \sum_i e_{h,i}\, r_{r,i}\, e_{t,i}

    Symmetric in :math:`h` and :math:`t`; against many candidates it is one matrix product.
    """

    def score_pairs(self, head: Tensor, rel: Tensor, tail: Tensor) -> Tensor:
        return (head * rel * tail).sum(dim=-1)

    def score_sets(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str) -> Tensor:
        return (anchor * rel) @ candidates.T


def build_kge_model(
    config: ModelConfig, num_entities: int, num_relations: int, entity_table: torch.nn.Module | None = None
) -> KGEModel:
    common = dict(reciprocal=config.reciprocal, init_std=config.init_std, dropout=config.dropout, entity_table=entity_table)
    if config.kind == "transe":
        return TransE(num_entities, num_relations, config.dim, p_norm=config.p_norm, **common)
    return DistMult(num_entities, num_relations, config.dim, **common)
