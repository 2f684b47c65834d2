"""ComplEx: a bilinear score in complex coordinates."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kge import SCORING_FUNCTIONS, QueryProduct, cubed_modulus, halves


@SCORING_FUNCTIONS.register_as("complex")
class ComplEx(QueryProduct):
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

    formula = "Re<h, r, conj(t)>"
    halves = "dim / 2 complex coordinates of a real and an imaginary part"
    meanings = {
        "entities": "complex vectors, columns [real parts | imaginary parts]; a triple scores Re<e_h, r, conj(e_t)>",
        "relations": "complex vectors, columns [real parts | imaginary parts]",
    }

    @staticmethod
    def tail_query(head: Tensor, rel: Tensor) -> Tensor:
        r"""``[re | im]`` of :math:`e_h r_r`: its dot product with ``[t_re | t_im]`` is the score."""
        (h_re, h_im), (r_re, r_im) = halves(head), halves(rel)
        return torch.cat([h_re * r_re - h_im * r_im, h_re * r_im + h_im * r_re], dim=-1)

    @staticmethod
    def head_query(tail: Tensor, rel: Tensor) -> Tensor:
        r"""``[a | b]`` with :math:`\operatorname{Re}(e\, r \overline{t}) = e_{re} \cdot a + e_{im} \cdot b`."""
        (t_re, t_im), (r_re, r_im) = halves(tail), halves(rel)
        return torch.cat([r_re * t_re + r_im * t_im, r_re * t_im - r_im * t_re], dim=-1)

    def n3(self, entities: Tensor, relations: Tensor) -> Tensor:
        return cubed_modulus(entities).sum() + cubed_modulus(relations).sum()
