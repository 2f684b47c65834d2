r"""The base of every knowledge-graph scoring function, and the registry they join.

A scoring function is one class in one module of :mod:`dsa_train.models.scoring`, registered
with ``@SCORING_FUNCTIONS.register_as("name")``; its class attributes declare what the rest of
the package needs to know (see :class:`KGEModel`).

All build on PyG's :class:`torch_geometric.nn.kge.KGEModel` (its ``node_emb`` and ``rel_emb``
tables with ``sparse=True``, its per-triple ``forward``). What PyG lacks, and this module adds:
scoring one query against a *set* of candidate entities at once (shared negatives in training,
all entities in evaluation), reciprocal relations, and the initialisation and dropout the
training recipes use.

With ``reciprocal=True`` the relation table has :math:`2|R|` rows: relation :math:`r + |R|`
is the inverse of :math:`r`, and a head query :math:`(?, r, t)` is asked as the tail query
:math:`(t, r + |R|, ?)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch_geometric.nn.kge
from torch import Tensor

from ..registry import Registry
from .dropout import dropout


class KGEModel(torch_geometric.nn.kge.KGEModel):
    """Entity and relation tables plus a score :math:`f(h, r, t)` (higher: more plausible).

    A subclass gives :meth:`score_pairs` and :meth:`score_sets`, and declares in class
    attributes what the recipe's checks, the memory sizing, sharded training, export and
    neighbour search need to know of it.
    """

    #: the recipe's ``model.kind`` (set by :meth:`~dsa_train.registry.Registry.register_as`)
    name: str = ""
    #: the score, one line, for help and errors
    formula: str = ""
    #: ``None`` for rows of ``dim`` real coordinates; else what the two halves of a row are
    #: (``[re | im]`` of ``dim / 2`` complex coordinates), and ``model.dim`` must be even
    halves: str | None = None
    #: ``None`` where relation dropout applies to the relation rows; else why it does not
    relation_dropout_unsupported: str | None = None
    #: the parameters every rank holds whole (and updates alike) when the entity table is sharded
    replicated: tuple[str, ...] = ("rel_emb",)
    #: ``model.*`` keys the constructor takes besides the common ones (``p_norm=...``)
    options: tuple[str, ...] = ()
    #: what an exported table's rows are, by table name
    meanings: dict[str, str] = {}

    @classmethod
    def relation_width(cls, dim: int) -> int:
        """Reals per relation row for ``model.dim`` = ``dim``."""
        return dim

    @classmethod
    def metric(cls, config) -> str:
        """The geometry the score compares entity rows with (``dot``, ``l1`` or ``l2``), for
        neighbour search; ``config`` is the recipe's ``model`` section."""
        return "dot"

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

    def score_candidates(
        self, anchor: Tensor, relation: Tensor, candidates: Tensor, side: str, *, out: Tensor | None = None
    ) -> Tensor:
        """``(B, K)`` scores of ``B`` queries against ``K`` candidate embeddings.

        ``anchor`` are the known entities' embeddings ``(B, D)``; ``relation`` the relation
        ids ``(B,)``; ``side`` says which end the candidates fill ("tail" or "head"); ``out``
        a ``(B, K)`` buffer the scores may be written into (see :meth:`score_sets`).
        """
        rel, side = self.query_relations(relation, side)
        return self.score_sets(anchor, rel, candidates, side, out=out)

    def score_entities(
        self, anchor: Tensor, relation: Tensor, candidates: Tensor, side: str, *, out: Tensor | None = None
    ) -> Tensor:
        """``(B, K)`` scores of queries given by ids against candidate entity ids (evaluation)."""
        device = self.rel_emb.weight.device
        return self.score_candidates(
            self.entities(anchor.to(device)), relation.to(device), self.entities(candidates.to(device)), side, out=out
        )

    def entity_scorer(self) -> Callable[..., Tensor]:
        """:meth:`score_entities` for one evaluation, which scores every batch of queries
        against the same chunks of entities: the last chunk's rows are kept and reused while
        the same ids come back (every batch, where the entities fit one chunk), instead of
        gathered again per batch. Valid while the model does not change."""
        kept_ids, kept_rows = torch.empty(0, dtype=torch.long), None

        def score(anchor: Tensor, relation: Tensor, candidates: Tensor, side: str, *, out: Tensor | None = None):
            nonlocal kept_ids, kept_rows
            device = self.rel_emb.weight.device
            if kept_ids.shape != candidates.shape or not torch.equal(kept_ids, candidates):
                kept_rows = None  # the old rows go before the new ones come
                kept_ids, kept_rows = candidates, self.entities(candidates.to(device))
            return self.score_candidates(
                self.entities(anchor.to(device)), relation.to(device), kept_rows, side, out=out
            )

        return score

    def answer_scores(self, anchor: Tensor, rel: Tensor, answer: Tensor, side: str) -> Tensor:
        """``(B,)`` scores of answers given the queries' relation embeddings ``rel`` and the side
        they score (both from :meth:`query_relations`)."""
        return self.score_pairs(anchor, rel, answer) if side == "tail" else self.score_pairs(answer, rel, anchor)

    def scores_with_answers(
        self, anchor: Tensor, rel: Tensor, answer: Tensor, candidates: Tensor, side: str
    ) -> tuple[Tensor, Tensor]:
        """:meth:`answer_scores` ``(B,)`` and :meth:`score_sets` ``(B, K)`` of the same queries
        (a training step's positives and negatives); a scoring function whose two share work
        computes it once."""
        return self.answer_scores(anchor, rel, answer, side), self.score_sets(anchor, rel, candidates, side)

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

    def score_sets(
        self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str, *, out: Tensor | None = None
    ) -> Tensor:
        """``(B, K)`` scores of ``B`` queries (``anchor`` rows, ``rel`` rows from
        :meth:`query_relations`) against ``K`` candidate rows filling ``side``. ``out``: a
        contiguous ``(B, K)`` buffer that, without autograd, may receive the scores (and is
        then returned), so that an evaluation reuses one matrix instead of allocating one per
        batch; see :func:`product`."""
        raise NotImplementedError

    def ranking_keys(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str) -> Tensor:
        """Without autograd: ``(B, K)`` keys that order candidates as :meth:`score_sets` does (a
        higher key never has a lower score), for a top-k that keeps only a few; a scoring function
        whose score is a monotone step away from a cheaper key (a distance from its square) gives
        the key and saves the passes of that step over the whole matrix. :meth:`scores_of_keys`
        turns the kept keys into the scores bit for bit. The default key is the score."""
        return self.score_sets(anchor, rel, candidates, side)

    def scores_of_keys(self, keys: Tensor) -> Tensor:
        """The scores of :meth:`ranking_keys`' keys, element by element (in place)."""
        return keys


class QueryProduct(KGEModel):
    r"""A scoring function whose score is a query's dot product with the candidate's row:
    :math:`f(h, r, t) = q_\text{tail}(h, r) \cdot t = q_\text{head}(t, r) \cdot h`, so against
    many candidates it is one matrix product. A subclass gives the two queries."""

    def score_pairs(self, head: Tensor, rel: Tensor, tail: Tensor) -> Tensor:
        return (self.tail_query(head, rel) * tail).sum(dim=-1)

    def score_sets(
        self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str, *, out: Tensor | None = None
    ) -> Tensor:
        query = self.tail_query(anchor, rel) if side == "tail" else self.head_query(anchor, rel)
        return product(query, candidates, out)

    def scores_with_answers(
        self, anchor: Tensor, rel: Tensor, answer: Tensor, candidates: Tensor, side: str
    ) -> tuple[Tensor, Tensor]:
        r"""The side's one query :math:`q` scores the answer, :math:`q \cdot a`, and the
        candidates: built once, where :meth:`answer_scores` and :meth:`score_sets` would each
        build it (a head query's answer then scores :math:`q_\text{head}(t, r) \cdot h`, the
        same score as :math:`q_\text{tail}(h, r) \cdot t` up to float rounding)."""
        query = self.tail_query(anchor, rel) if side == "tail" else self.head_query(anchor, rel)
        return (query * answer).sum(dim=-1), product(query, candidates)

    @staticmethod
    def tail_query(head: Tensor, rel: Tensor) -> Tensor:
        """``q`` with ``q . c`` the score of ``(head, rel, c)``."""
        raise NotImplementedError

    @staticmethod
    def head_query(tail: Tensor, rel: Tensor) -> Tensor:
        """``q`` with ``q . c`` the score of ``(c, rel, tail)``."""
        raise NotImplementedError


def product(query: Tensor, candidates: Tensor, out: Tensor | None = None) -> Tensor:
    """``query @ candidates.T``, written into ``out`` where it can take it: no autograd on
    either side, and ``out`` a contiguous buffer of the result's shape, dtype and device
    (otherwise a new matrix). The same matrix product either way, so the same bits."""
    fits = (
        out is not None
        and out.shape == (len(query), len(candidates))
        and out.dtype == query.dtype
        and out.device == query.device
        and out.is_contiguous()
        and not (torch.is_grad_enabled() and (query.requires_grad or candidates.requires_grad))
    )
    return torch.matmul(query, candidates.T, out=out) if fits else query @ candidates.T


def euclidean(query: Tensor, candidates: Tensor, out: Tensor | None = None) -> Tensor:
    r"""``(B, K)`` Euclidean distances of ``B`` queries to ``K`` candidates in one matrix product:
    :math:`\lVert q - e \rVert^2 = \lVert q \rVert^2 - 2\, q \cdot e + \lVert e \rVert^2`.
    Without autograd (evaluation, prediction) the ``(B, K)`` matrix is reused in place: the same
    operations in the same order, so the same bits, at about half the memory traffic."""
    if torch.is_grad_enabled() and (query.requires_grad or candidates.requires_grad):
        squared = (query * query).sum(1, keepdim=True) - 2 * query @ candidates.T + (candidates * candidates).sum(1)
        return squared.clamp_min(1e-12).sqrt()
    return distances_of_squares(squared_distances(query, candidates, out))


def squared_distances(query: Tensor, candidates: Tensor, out: Tensor | None = None) -> Tensor:
    r"""``(B, K)`` squared Euclidean distances, without autograd, as :func:`euclidean` makes
    them: :math:`-(2q) \cdot e + \lVert q \rVert^2 + \lVert e \rVert^2`, in place, in that order."""
    squared = product(2 * query, candidates, out)
    return squared.neg_().add_((query * query).sum(1, keepdim=True)).add_((candidates * candidates).sum(1))


def negative_squared_distances(query: Tensor, candidates: Tensor) -> Tensor:
    r"""Minus :func:`squared_distances`, without autograd, in two passes fewer:
    :math:`(2q) \cdot e - \lVert q \rVert^2 - \lVert e \rVert^2` in the same order, which rounds
    to the negated value exactly (round-to-nearest is symmetric; a zero may change sign)."""
    negative = (2 * query) @ candidates.T
    return negative.sub_((query * query).sum(1, keepdim=True)).sub_((candidates * candidates).sum(1))


def distances_of_squares(squared: Tensor) -> Tensor:
    """The distances of :func:`squared_distances`' matrix (or of any of its entries), in place."""
    return squared.clamp_min_(1e-12).sqrt_()


def subtracted_from(offset: float | None, distance: Tensor) -> Tensor:
    """``offset - distance`` (``-distance`` for ``None``), in place when autograd does not
    track ``distance``: the same bits without a second ``(B, K)`` matrix."""
    if distance.requires_grad:
        return -distance if offset is None else offset - distance
    distance.neg_()
    return distance if offset is None else distance.add_(offset)


def halves(x: Tensor) -> tuple[Tensor, Tensor]:
    """The real and imaginary parts of rows laid out ``[re | im]``."""
    return x.chunk(2, dim=-1)


def cubed_modulus(x: Tensor) -> Tensor:
    """:math:`|z|^3` of each complex coordinate of rows laid out ``[re | im]``, as
    :math:`(re^2 + im^2)^{3/2}`: its gradient at 0 is 0, where ``|z| ** 3`` would give NaN."""
    re, im = halves(x)
    return (re * re + im * im).pow(1.5)


#: every scoring function, by ``model.kind``; :mod:`dsa_train.models.scoring` imports them all
SCORING_FUNCTIONS: Registry[type[KGEModel]] = Registry("knowledge-graph scoring function", "model.kind")
