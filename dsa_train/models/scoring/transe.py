"""TransE: relations translate heads onto tails."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kge import (
    SCORING_FUNCTIONS,
    KGEModel,
    distances_of_squares,
    euclidean,
    negative_squared_distances,
    subtracted_from,
)


@SCORING_FUNCTIONS.register_as("transe")
class TransE(KGEModel):
    r"""TransE (Bordes et al., NeurIPS 2013): relations translate heads onto tails.

    .. math::
        f(h, r, t) = -\lVert \mathbf{e}_h + \mathbf{r}_r - \mathbf{e}_t \rVert_p

    Against many candidates, :math:`p = 2` uses
    :math:`\lVert q - e \rVert^2 = \lVert q \rVert^2 - 2\, q \cdot e + \lVert e \rVert^2` (one
    matrix product); :math:`p = 1` uses ``torch.cdist``.
    """

    formula = "-||h + r - t||_p"
    options = ("p_norm",)
    meanings = {"entities": "entity vectors e; a triple scores -||e_h + r - e_t||_p", "relations": "translations r"}

    @classmethod
    def metric(cls, config) -> str:
        return f"l{config.p_norm}"

    def __init__(self, *args, p_norm: int = 2, **kwargs) -> None:
        self.p_norm = p_norm
        super().__init__(*args, **kwargs)

    def score_pairs(self, head: Tensor, rel: Tensor, tail: Tensor) -> Tensor:
        return -(head + rel - tail).norm(p=self.p_norm, dim=-1)

    def score_sets(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str, *, out=None) -> Tensor:
        query = _query(anchor, rel, side)
        if self.p_norm == 1:  # torch.cdist takes no output buffer
            return subtracted_from(None, torch.cdist(query, candidates, p=1))
        return subtracted_from(None, euclidean(query, candidates, out))

    def ranking_keys(self, anchor: Tensor, rel: Tensor, candidates: Tensor, side: str) -> Tensor:
        """With :math:`p = 2`: minus the squared distance (the score without its square root)."""
        if self.p_norm == 1:
            return super().ranking_keys(anchor, rel, candidates, side)
        return negative_squared_distances(_query(anchor, rel, side), candidates)

    def scores_of_keys(self, keys: Tensor) -> Tensor:
        return keys if self.p_norm == 1 else subtracted_from(None, distances_of_squares(keys.neg_()))


def _query(anchor: Tensor, rel: Tensor, side: str) -> Tensor:
    """The point the candidates are measured from. Tail side: -||(h + r) - e||; head side:
    -||e + r - t|| = -||(t - r) - e||."""
    return anchor + rel if side == "tail" else anchor - rel
