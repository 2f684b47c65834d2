"""RotatE: relations rotate heads onto tails in the complex plane."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kge import (
    SCORING_FUNCTIONS,
    KGEModel,
    cubed_modulus,
    distances_of_squares,
    euclidean,
    halves,
    negative_squared_distances,
    subtracted_from,
)


@SCORING_FUNCTIONS.register_as("rotate")
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

    formula = "gamma - ||h o r - t||, r a rotation"
    halves = "dim / 2 complex coordinates of a real and an imaginary part"
    relation_dropout_unsupported = "rotate's relations are rotation angles, which dropout would turn into no rotation"
    options = ("gamma",)
    meanings = {
        "entities": "complex vectors, columns [real parts | imaginary parts]; a triple scores -||e_h o r - e_t||",
        "relations": "phases in radians, one per complex coordinate: r = cos(phase) + i sin(phase)",
    }

    @classmethod
    def relation_width(cls, dim: int) -> int:
        return dim // 2

    @classmethod
    def metric(cls, config) -> str:
        return "l2"

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

    def score_sets(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str, *, out=None) -> Tensor:
        return subtracted_from(self.gamma, euclidean(_rotate(anchor, rel if side == "tail" else -rel), candidates, out))

    def scores_with_answers(
        self, anchor: Tensor, rel: Tensor, answer: Tensor, candidates: Tensor, side: str
    ) -> tuple[Tensor, Tensor]:
        r"""One rotation of the anchors scores the answers and the candidates (a head query's
        answer: :math:`\gamma - \lVert e_t \circ \overline{r} - e_h \rVert`, the same score up to
        float rounding, rotations keeping distances)."""
        query = _rotate(anchor, rel if side == "tail" else -rel)
        return self.gamma - (query - answer).norm(dim=-1), subtracted_from(self.gamma, euclidean(query, candidates))

    def ranking_keys(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str) -> Tensor:
        """Minus the squared distance: the score without its square root and its ``gamma``."""
        return negative_squared_distances(_rotate(anchor, rel if side == "tail" else -rel), candidates)

    def scores_of_keys(self, keys: Tensor) -> Tensor:
        return subtracted_from(self.gamma, distances_of_squares(keys.neg_()))

    def n3(self, entities: Tensor, relations: Tensor) -> Tensor:
        return cubed_modulus(entities).sum()


def _rotate(x: Tensor, phase: Tensor) -> Tensor:
    r"""Rows ``[re | im]`` multiplied by :math:`e^{i \theta}` coordinate by coordinate."""
    re, im = halves(x)
    cos, sin = phase.cos(), phase.sin()
    return torch.cat([re * cos - im * sin, re * sin + im * cos], dim=-1)
