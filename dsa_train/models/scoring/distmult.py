"""DistMult: a diagonal bilinear score."""

from __future__ import annotations

from torch import Tensor

from ..kge import SCORING_FUNCTIONS, QueryProduct


@SCORING_FUNCTIONS.register_as("distmult")
class DistMult(QueryProduct):
    r"""DistMult (Yang et al., ICLR 2015): a diagonal bilinear score.

    .. math::
        f(h, r, t) = \langle \mathbf{e}_h, \mathbf{r}_r, \mathbf{e}_t \rangle
                   = \sum_i e_{h,i}\, r_{r,i}\, e_{t,i}

    Symmetric in :math:`h` and :math:`t`; against many candidates it is one matrix product.
    """

    formula = "<h, r, t>"
    meanings = {
        "entities": "entity vectors e; a triple scores sum_i e_h,i r_i e_t,i",
        "relations": "diagonals r of the bilinear form",
    }

    @staticmethod
    def tail_query(head: Tensor, rel: Tensor) -> Tensor:
        return head * rel

    @staticmethod
    def head_query(tail: Tensor, rel: Tensor) -> Tensor:
        return tail * rel
