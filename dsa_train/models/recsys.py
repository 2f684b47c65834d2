r"""DLRM (Naumov et al. 2019): a click model over sparse categorical features and dense ones.

For an impression with dense features :math:`\mathbf x \in \mathbb R^{D}` and, per categorical
feature :math:`f = 1 \dots F`, a bag of table rows :math:`B_f` with weights :math:`w_j`
(1 without per-sample weights):

.. math::
    \mathbf e_f = \sum_{j \in B_f} w_j \mathbf E_j \ \ (\texttt{sum}), \qquad
    \mathbf e_f = \frac{1}{|B_f|} \sum_{j \in B_f} \mathbf E_j \ \ (\texttt{mean}),
    \qquad \mathbf e_0 = \mathrm{MLP}_\text{bottom}(\mathbf x) \in \mathbb R^d

(an empty bag pools to :math:`\mathbf 0`; without dense features :math:`\mathbf e_0` is a
learned constant), then with ``interaction: dot``
:math:`\mathbf h = [\mathbf e_0, (\mathbf e_a^\top \mathbf e_b)_{0 \le a < b \le F}]` and with
``cat`` :math:`\mathbf h = [\mathbf e_0, \mathbf e_1, \dots, \mathbf e_F]`; the click logit is
:math:`z = \mathrm{MLP}_\text{top}(\mathbf h)` (ReLU between layers, none after the last), trained
with the logistic loss :math:`\mathrm{softplus}(z) - y z`.

The rows :math:`\mathbf E` form one table (``nn.EmbeddingBag(sparse=True)``, or a
:class:`~dsa_train.nn.DiskEmbeddingBag` on disk), as FBGEMM's batched tables put many
features in one: with ``tables: per_feature`` feature :math:`f` owns rows
:math:`[fR, (f + 1)R)` and value :math:`v` takes row :math:`fR + (v \bmod R)`; with ``shared``
every value of every feature hashes into the same :math:`R` rows,
:math:`\mathrm{mix}(v \cdot F + f) \bmod R` (:func:`~dsa_train.data.fingerprint.mix64`).
Only the table is sparse; the MLPs are dense and train with torch's Adam.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.fingerprint import mix64


def table_rows(values: Tensor, feature: Tensor, *, features: int, rows: int, shared: bool) -> Tensor:
    """The table row of each categorical ``value`` of its ``feature`` (see the module docstring)."""
    if not shared:
        return feature * rows + torch.remainder(values, rows)
    with np.errstate(over="ignore"):
        keys = values.numpy().astype(np.uint64) * np.uint64(features) + feature.numpy().astype(np.uint64)
    return torch.from_numpy((mix64(keys) % np.uint64(rows)).astype(np.int64))


def mlp(widths: list[int]) -> nn.Sequential:
    """Linear layers of these widths (input first) with ReLU between them, none after the last."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """``table``: a ready bag table (a DiskEmbeddingBag), or a checkpoint's table (any module
    that maps row ids to rows), instead of a new ``nn.EmbeddingBag``."""

    def __init__(
        self,
        num_rows: int,
        dim: int,
        *,
        features: int,
        dense: int,
        bottom: list[int],
        top: list[int],
        interaction: str = "dot",
        mode: str = "sum",
        init_std: float = 0.01,
        table: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if table is None:
            table = nn.EmbeddingBag(num_rows, dim, mode=mode, sparse=True)
            nn.init.normal_(table.weight, std=init_std)
        self.table, self.mode, self.features, self.dim, self.interaction = table, mode, features, dim, interaction
        if dense:
            self.bottom = mlp([dense, *bottom, dim])
        else:
            self.constant = nn.Parameter(torch.randn(dim) * dim**-0.5)
        vectors = features + 1
        width = dim + vectors * (vectors - 1) // 2 if interaction == "dot" else dim * vectors
        self.top = mlp([width, *top, 1])

    def pooled(self, rows: Tensor, offsets: Tensor, weights: Tensor | None) -> Tensor:
        """The bags' pooled rows ``(bags, dim)``; a table without bags (a checkpoint's, read
        row by row) looks up each distinct row once and pools them the same way."""
        if hasattr(self.table, "mode"):  # nn.EmbeddingBag, DiskEmbeddingBag
            return self.table(rows, offsets, per_sample_weights=weights)
        distinct, local = torch.unique(rows, return_inverse=True)
        return F.embedding_bag(
            local, self.table(distinct), offsets.to(local.device), mode=self.mode, per_sample_weights=weights
        )

    def forward(self, dense: Tensor, rows: Tensor, offsets: Tensor, weights: Tensor | None = None) -> Tensor:
        """Click logits ``(B,)`` of ``B`` impressions: ``dense`` ``(B, D)``, bag ``b`` of
        ``rows[offsets[b]:offsets[b + 1]]`` is feature ``b % F`` of impression ``b // F``."""
        b = len(dense)
        e = self.pooled(rows, offsets, weights).to(dense.device).view(b, self.features, self.dim)
        e0 = self.bottom(dense) if hasattr(self, "bottom") else self.constant.expand(b, self.dim)
        vectors = torch.cat([e0[:, None], e], 1)
        if self.interaction == "dot":
            gram = torch.bmm(vectors, vectors.transpose(1, 2))
            a, c = torch.triu_indices(len(gram[0]), len(gram[0]), offset=1, device=gram.device)
            h = torch.cat([e0, gram[:, a, c]], 1)
        else:
            h = vectors.reshape(b, -1)
        return self.top(h).squeeze(1)

    @staticmethod
    def loss(logits: Tensor, labels: Tensor) -> Tensor:
        """The mean logistic loss (binary cross-entropy on the logits)."""
        return F.binary_cross_entropy_with_logits(logits, labels)
