"""SimplE: CP decomposition with each relation's inverse, so head and tail vectors learn together."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kge import SCORING_FUNCTIONS, QueryProduct, halves


@SCORING_FUNCTIONS.register_as("simple")
class SimplE(QueryProduct):
    r"""SimplE (Kazemi and Poole, NeurIPS 2018, https://arxiv.org/abs/1802.04868).

    Each entity :math:`e` has a head-role vector :math:`h_e` and a tail-role vector :math:`t_e`,
    each relation :math:`r` a vector :math:`v_r` and one for its inverse :math:`v_{r^{-1}}`:

    .. math::
        f(h, r, t) = \tfrac{1}{2} \left( \langle h_h, v_r, t_t \rangle
                                       + \langle h_t, v_{r^{-1}}, t_h \rangle \right)

    with :math:`\langle a, b, c \rangle = \sum_i a_i b_i c_i`. A row of ``dim`` reals is
    ``[h_e | t_e]`` (entities) or ``[v_r | v_{r^{-1}}]`` (relations), so ``dim`` is even.
    Against many candidates :math:`c` the score is one matrix product with ``[h_c | t_c]``:
    a tail query :math:`(a, r, ?)` is
    :math:`\tfrac{1}{2} [v_{r^{-1}} \odot t_a \mid h_a \odot v_r]`, a head query :math:`(?, r, a)`
    is :math:`\tfrac{1}{2} [v_r \odot t_a \mid h_a \odot v_{r^{-1}}]`.
    """

    formula = "(<h_h, r, t_t> + <h_t, r^-1, t_h>) / 2"
    halves = (
        "a head-role and a tail-role vector (entities), a relation's and its inverse's vector (relations), dim / 2 each"
    )
    meanings = {
        "entities": "columns [head-role vector | tail-role vector]; a triple scores (<h_head, r, t_tail> + <h_tail, r_inverse, t_head>) / 2",
        "relations": "columns [relation vector r | inverse vector r_inverse]",
    }

    @staticmethod
    def tail_query(head: Tensor, rel: Tensor) -> Tensor:
        """``q`` with ``q . [h_c | t_c]`` the score of ``(head, rel, c)``."""
        (h, t), (forward, inverse) = halves(head), halves(rel)
        return 0.5 * torch.cat([inverse * t, h * forward], dim=-1)

    @staticmethod
    def head_query(tail: Tensor, rel: Tensor) -> Tensor:
        """``q`` with ``q . [h_c | t_c]`` the score of ``(c, rel, tail)``."""
        (h, t), (forward, inverse) = halves(tail), halves(rel)
        return 0.5 * torch.cat([forward * t, h * inverse], dim=-1)
