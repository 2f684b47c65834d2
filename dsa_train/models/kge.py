r"""TransE, DistMult, ComplEx and RotatE with sparse entity and relation embeddings.

All build on PyG's :class:`torch_geometric.nn.kge.KGEModel` (its ``node_emb`` and
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
from .dropout import dropout


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
        relation_dropout: float = 0.0,
        normalize_entities: bool = False,
        entity_table: torch.nn.Module | None = None,
    ) -> None:
        self.num_base_relations = num_relations
        self.reciprocal = reciprocal
        self.init_std = init_std
        self.dropout, self.relation_dropout = dropout, relation_dropout
        self.normalize_entities = normalize_entities
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
        return self.score_pairs(self.entities(head_index), self.rel_emb(rel_type), self.entities(tail_index))

    def relation_for(self, relation: Tensor, side: str) -> tuple[Tensor, str]:
        """The relation rows and the side to score, with a head query turned around if reciprocal."""
        if self.reciprocal and side == "head":
            return relation + self.num_base_relations, "tail"
        return relation, side

    def query_relations(self, relation: Tensor, side: str) -> tuple[Tensor, str]:
        """The relation embeddings of queries asking for ``side`` (a head query's inverse
        relation if reciprocal), with relation dropout while training, and the side they score.
        Look them up once per query: its answer and its candidates then share one mask."""
        rows, side = self.relation_for(relation, side)
        return dropout(self.rel_emb(rows), self.relation_dropout, self.training), side

    def score_candidates(self, anchor: Tensor, relation: Tensor, candidates: Tensor, side: str) -> Tensor:
        """``(B, K)`` scores of ``B`` queries against ``K`` candidate embeddings.

        ``anchor`` are the known entities' embeddings ``(B, D)``; ``relation`` the relation
        ids ``(B,)``; ``side`` says which end the candidates fill ("tail" or "head").
        """
        rel, side = self.query_relations(relation, side)
        return self.score_sets(anchor, rel, candidates, side)

    def score_entities(self, anchor: Tensor, relation: Tensor, candidates: Tensor, side: str) -> Tensor:
        """``(B, K)`` scores of queries given by ids against candidate entity ids (evaluation)."""
        device = self.rel_emb.weight.device
        return self.score_candidates(self.entities(anchor.to(device)), relation.to(device), self.entities(candidates.to(device)), side)

    def answer_scores(self, anchor: Tensor, rel: Tensor, answer: Tensor, side: str) -> Tensor:
        """``(B,)`` scores of answers given the queries' relation embeddings ``rel`` and the side
        they score (both from :meth:`query_relations`)."""
        return self.score_pairs(anchor, rel, answer) if side == "tail" else self.score_pairs(answer, rel, anchor)

    def constrain(self, rows: Tensor) -> Tensor:
        r"""Entity rows as every score sees them: with ``normalize_entities``, projected onto the
        unit sphere, :math:`\mathbf{e} / \lVert \mathbf{e} \rVert_2` (the TransE paper's
        constraint, applied in the forward pass so that the stored rows and their moments stay
        the optimizer's alone); otherwise unchanged."""
        return F.normalize(rows, dim=-1) if self.normalize_entities else rows

    def entities(self, ids: Tensor) -> Tensor:
        """The (constrained) embeddings of entities ``ids``."""
        return self.constrain(self.node_emb(ids))

    def embed(self, entities: Tensor) -> Tensor:
        """Entity embeddings, with dropout while training."""
        return dropout(self.entities(entities), self.dropout, self.training)

    def n3(self, entities: Tensor, relations: Tensor) -> Tensor:
        r"""The N3 penalty :math:`\sum |x|^3` of a step's entity and relation rows (Lacroix et
        al., 2018), over each real coordinate."""
        return entities.abs().pow(3).sum() + relations.abs().pow(3).sum()

    def score_pairs(self, head: Tensor, rel: Tensor, tail: Tensor) -> Tensor:
        raise NotImplementedError

    def score_sets(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str) -> Tensor:
        raise NotImplementedError


def euclidean(query: Tensor, candidates: Tensor) -> Tensor:
    r"""``(B, K)`` Euclidean distances of ``B`` queries to ``K`` candidates in one matrix product:
    :math:`\lVert q - e \rVert^2 = \lVert q \rVert^2 - 2\, q \cdot e + \lVert e \rVert^2`.
    Without autograd (evaluation, prediction) the ``(B, K)`` matrix is reused in place: the same
    operations in the same order, so the same bits, at about half the memory traffic."""
    if torch.is_grad_enabled() and (query.requires_grad or candidates.requires_grad):
        squared = (query * query).sum(1, keepdim=True) - 2 * query @ candidates.T + (candidates * candidates).sum(1)
        return squared.clamp_min(1e-12).sqrt()
    squared = (2 * query) @ candidates.T
    squared.neg_().add_((query * query).sum(1, keepdim=True)).add_((candidates * candidates).sum(1))
    return squared.clamp_min_(1e-12).sqrt_()


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
        return -euclidean(query, candidates)


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


def halves(x: Tensor) -> tuple[Tensor, Tensor]:
    """The real and imaginary parts of rows laid out ``[re | im]``."""
    return x.chunk(2, dim=-1)


def cubed_modulus(x: Tensor) -> Tensor:
    """:math:`|z|^3` of each complex coordinate of rows laid out ``[re | im]``, as
    :math:`(re^2 + im^2)^{3/2}`: its gradient at 0 is 0, where ``|z| ** 3`` would give NaN."""
    re, im = halves(x)
    return (re * re + im * im).pow(1.5)


class ComplEx(KGEModel):
    r"""ComplEx (Trouillon et al., ICML 2016), as PyG's ``ComplEx`` scores it.

    .. math::
        f(h, r, t) = \operatorname{Re} \langle \mathbf{e}_h, \mathbf{r}_r, \overline{\mathbf{e}_t} \rangle
                   = \sum_i \operatorname{Re}(e_{h,i}\, r_{r,i}\, \overline{e_{t,i}})

    ``dim`` counts reals: a row ``[re | im]`` holds ``dim / 2`` complex coordinates, so a
    ComplEx table is as large as a DistMult table of the same ``dim``. Against many candidates
    it is one matrix product: the tail query :math:`q = e_h r_r` (complex product) scores
    :math:`\operatorname{Re}\langle q, \overline{e}\rangle = q_{re} \cdot e_{re} + q_{im}
    \cdot e_{im}`; the head query :math:`q = r_r \overline{e_t}` scores
    :math:`\operatorname{Re}\langle e, \overline{\overline{q}}\rangle` likewise. N3 is taken
    over the moduli of the complex coordinates, as Lacroix et al. do.
    """

    def score_pairs(self, head: Tensor, rel: Tensor, tail: Tensor) -> Tensor:
        return (self._tail_query(head, rel) * tail).sum(dim=-1)

    def score_sets(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str) -> Tensor:
        query = self._tail_query(anchor, rel) if side == "tail" else self._head_query(anchor, rel)
        return query @ candidates.T

    @staticmethod
    def _tail_query(head: Tensor, rel: Tensor) -> Tensor:
        r"""``[re | im]`` of :math:`e_h r_r`: its dot product with ``[t_re | t_im]`` is the score."""
        (h_re, h_im), (r_re, r_im) = halves(head), halves(rel)
        return torch.cat([h_re * r_re - h_im * r_im, h_re * r_im + h_im * r_re], dim=-1)

    @staticmethod
    def _head_query(tail: Tensor, rel: Tensor) -> Tensor:
        r"""``[a | b]`` with :math:`\operatorname{Re}(e\, r \overline{t}) = e_{re} \cdot a + e_{im} \cdot b`."""
        (t_re, t_im), (r_re, r_im) = halves(tail), halves(rel)
        return torch.cat([r_re * t_re + r_im * t_im, r_re * t_im - r_im * t_re], dim=-1)

    def n3(self, entities: Tensor, relations: Tensor) -> Tensor:
        return cubed_modulus(entities).sum() + cubed_modulus(relations).sum()


class RotatE(KGEModel):
    r"""RotatE (Sun et al., ICLR 2019), as PyG's ``RotatE`` scores it: relations rotate heads
    onto tails in the complex plane.

    .. math::
        f(h, r, t) = \gamma - \lVert \mathbf{e}_h \circ \mathbf{r}_r - \mathbf{e}_t \rVert_2,
        \qquad r_{r,i} = \cos\theta_{r,i} + i \sin\theta_{r,i}

    the norm over every real and imaginary coordinate. ``dim`` counts reals: an entity row
    ``[re | im]`` holds ``dim / 2`` complex coordinates, a relation row ``dim / 2`` phases
    :math:`\theta` (drawn uniformly in :math:`[0, 2\pi)`). :math:`\gamma` (``model.gamma``)
    shifts every score alike: only the softplus loss sees it. Against many candidates the
    tail query :math:`e_h \circ r_r` and the head query :math:`e_t \circ \overline{r_r}`
    (rotations keep distances: :math:`|e r - t| = |e - t \overline{r}|`) are compared to
    every candidate with one matrix product, as TransE's are. N3 applies to the entities'
    moduli only (a rotation has modulus 1).
    """

    def __init__(self, num_entities: int, num_relations: int, dim: int, *, gamma: float = 1.0, **kwargs) -> None:
        self.gamma = gamma
        super().__init__(num_entities, num_relations, dim, **kwargs)
        self.rel_emb = torch.nn.Embedding(self.rel_emb.num_embeddings, dim // 2, sparse=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.uniform_(self.rel_emb.weight, 0, 2 * torch.pi)

    def score_pairs(self, head: Tensor, rel: Tensor, tail: Tensor) -> Tensor:
        return self.gamma - (_rotate(head, rel) - tail).norm(dim=-1)

    def score_sets(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str) -> Tensor:
        return self.gamma - euclidean(_rotate(anchor, rel if side == "tail" else -rel), candidates)

    def n3(self, entities: Tensor, relations: Tensor) -> Tensor:
        return cubed_modulus(entities).sum()


def _rotate(x: Tensor, phase: Tensor) -> Tensor:
    r"""Rows ``[re | im]`` multiplied by :math:`e^{i \theta}` coordinate by coordinate."""
    re, im = halves(x)
    cos, sin = phase.cos(), phase.sin()
    return torch.cat([re * cos - im * sin, re * sin + im * cos], dim=-1)


def build_kge_model(
    config: ModelConfig, num_entities: int, num_relations: int, entity_table: torch.nn.Module | None = None
) -> KGEModel:
    common = dict(
        reciprocal=config.reciprocal, init_std=config.init_std, dropout=config.dropout,
        relation_dropout=config.relation_dropout, normalize_entities=config.normalize_entities, entity_table=entity_table,
    )  # fmt: skip
    if config.kind == "transe":
        return TransE(num_entities, num_relations, config.dim, p_norm=config.p_norm, **common)
    if config.kind == "complex":
        return ComplEx(num_entities, num_relations, config.dim, **common)
    if config.kind == "rotate":
        return RotatE(num_entities, num_relations, config.dim, gamma=config.gamma, **common)
    return DistMult(num_entities, num_relations, config.dim, **common)
