r"""The row-wise SparseAdam update, written once and testable alone.

For a parameter whose gradient touches the rows :math:`R` (duplicates summed into
:math:`g_r`), at step :math:`t` with learning rate :math:`\gamma`:

.. math::
    m_r &\leftarrow m_r + (1 - \beta_1)\,(g_r - m_r) \\
    v_r &\leftarrow v_r + (1 - \beta_2)\,(g_r^2 - v_r) \\
    \theta_r &\leftarrow \theta_r - \gamma\,\frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}\,
        \frac{m_r}{\sqrt{v_r} + \epsilon}
        \qquad \text{for } r \in R \text{ only}

(:math:`g \to -g` when maximizing). This is exactly ``torch.optim.SparseAdam``'s update, and
every floating-point operation happens in the same order and precision, so the results agree
bit for bit on CPU.

The work goes in chunks of rows that fit in the CPU cache: each chunk gathers its
``[m | v]`` records once, updates them in place, scatters them back once, and hands the
parameter update to a callback. Duplicate lookups are grouped by one sort of the row indices,
the same ``torch.sort`` that ``Tensor.coalesce`` runs, and summed chunk by chunk in that sort's
order, as ``coalesce`` sums them; skipping coalesce's full copy of the values makes this
several times cheaper.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

#: Bytes of ``[m | v]`` records one chunk gathers; about a quarter of a typical L2 cache.
CHUNK_BYTES = 1 << 20


@dataclass
class RowGradient:
    """A row-sparse gradient with duplicate lookups grouped but not yet summed.

    ``rows`` are the unique touched rows, ascending. ``values`` holds one gradient row per
    lookup, ``(nnz, W)``. When the gradient was not coalesced, ``order`` is the sort
    permutation of the lookups (the one ``coalesce`` uses), ``segment`` the unique-row number of each sorted
    lookup and ``starts`` where each unique row's lookups begin in ``order`` (length U + 1).
    Without duplicates ``segment`` and ``starts`` are ``None``; for an already coalesced
    gradient ``order`` is ``None`` too and ``values[i]`` belongs to ``rows[i]``.
    """

    rows: Tensor
    values: Tensor
    order: Tensor | None = None
    segment: Tensor | None = None
    starts: Tensor | None = None

    @classmethod
    def from_sparse(cls, grad: Tensor) -> RowGradient:
        """Group the lookups of a sparse COO gradient with one sparse dimension (on CPU)."""
        if grad.dtype in (torch.float16, torch.bfloat16):
            # coalesce rounds to half precision after every addition; index_add_ would
            # accumulate duplicates in float32 and round once, which is not SparseAdam.
            grad = grad.coalesce()
        values = grad._values()
        values = values.reshape(values.shape[0], -1)
        lookups = grad._indices()[0]
        if grad.is_coalesced():
            return cls(lookups, values)
        sorted_rows, order = torch.sort(lookups)
        is_first = torch.ones_like(sorted_rows, dtype=torch.bool)
        torch.ne(sorted_rows[1:], sorted_rows[:-1], out=is_first[1:])
        starts = is_first.nonzero().squeeze(1)
        rows = sorted_rows[starts]
        if rows.numel() == lookups.numel():  # no duplicates: the sort order is enough
            return cls(rows, values, order)
        segment = is_first.cumsum(0).sub_(1)
        starts = torch.cat([starts, starts.new_tensor([lookups.numel()])])
        return cls(rows, values, order, segment, starts)

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    def summed(self, begin: int, end: int, out: Tensor) -> Tensor:
        """The gradient of unique rows ``begin:end``, duplicates summed in lookup order."""
        if self.order is None:
            return self.values[begin:end]
        if self.starts is None:
            return torch.index_select(self.values, 0, self.order[begin:end], out=out[: end - begin])
        first, last = self.starts[[begin, end]].tolist()
        picked = self.values.index_select(0, self.order[first:last])
        if last - first == end - begin:
            return picked
        out = out[: end - begin].zero_()
        return out.index_add_(0, self.segment[first:last] - begin, picked)


class Workspace:
    """Reusable chunk buffers, so a step allocates (and page-faults) nothing per chunk."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    def get(self, width: int, dtype: torch.dtype) -> tuple[int, tuple[Tensor, Tensor, Tensor, Tensor]]:
        chunk = max(16, CHUNK_BYTES // max(1, 2 * width * dtype.itemsize))
        key = (width, dtype)
        if key not in self._buffers:
            self._buffers[key] = (
                torch.empty(chunk, 2, width, dtype=dtype),  # gathered [m | v] records
                torch.empty(chunk, width, dtype=dtype),  # m increment, then the update
                torch.empty(chunk, width, dtype=dtype),  # v increment, then the denominator
                torch.empty(chunk, width, dtype=dtype),  # summed gradient
            )
        return chunk, self._buffers[key]


def sparse_adam_rows_(
    moments: Tensor,
    grad: RowGradient,
    apply_update: Callable[[int, Tensor, Tensor], None],
    *,
    step: int,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    maximize: bool,
    workspace: Workspace,
) -> None:
    """Update the touched rows of ``moments`` (``(N, 2, W)``: m, v) in place.

    ``apply_update(begin, rows, update)`` receives, chunk by chunk, the parameter update of
    unique rows ``begin:begin + len(rows)`` (the caller adds it to the parameter).
    """
    # With a tensor lr this is tensor arithmetic in lr's dtype, exactly as in SparseAdam.
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    neg_step_size = -step_size.cpu() if isinstance(step_size, Tensor) else -step_size
    chunk, (records, m_inc, v_inc, grad_buf) = workspace.get(moments.shape[2], moments.dtype)
    for begin in range(0, grad.num_rows, chunk):
        end = min(begin + chunk, grad.num_rows)
        n = end - begin
        rows = grad.rows[begin:end]
        g = grad.summed(begin, end, grad_buf)
        record = torch.index_select(moments, 0, rows, out=records[:n])
        m, v = record[:, 0], record[:, 1]
        if maximize:  # (-g) - m == -(g + m) exactly
            d_m = torch.add(g, m, out=m_inc[:n]).neg_()
        else:
            d_m = torch.sub(g, m, out=m_inc[:n])
        m.add_(d_m.mul_(1 - beta1))
        d_v = torch.mul(g, g, out=v_inc[:n]).sub_(v).mul_(1 - beta2)
        v.add_(d_v)
        moments.index_copy_(0, rows, record)
        denom = torch.sqrt(v, out=v_inc[:n]).add_(eps)
        update = torch.div(m, denom, out=m_inc[:n]).mul_(neg_step_size)
        apply_update(begin, rows, update)
