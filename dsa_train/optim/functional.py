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
bit for bit.

Two implementations, checked against each other:

* :func:`fused_sparse_adam_rows_` runs the compiled kernel of :mod:`.native`: per row, one
  read and one write of its ``[m | v]`` record and of its parameter row, duplicates summed on
  the fly, rows split over threads, the next rows prefetched. Only ``sqrt`` is left to torch.
* :func:`sparse_adam_rows_` does the same with torch operations on cache-sized chunks of rows.
  It serves half-precision tables, odd parameter layouts, and machines without a C compiler.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
from torch import Tensor

#: Bytes of ``[m | v]`` records one chunk of the torch path gathers (a fraction of L2).
CHUNK_BYTES = 1 << 20
#: Elements of one fused chunk: at most torch's parallel grain, so the ``sqrt`` between the
#: two kernel passes runs on the calling worker thread instead of opening a nested team.
FUSED_CHUNK_ELEMENTS = 32768
#: Fewer touched rows than this per thread are not worth a thread.
MIN_ROWS_PER_THREAD = 2048


def _sort_lookups(lookups: Tensor, *, stable: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``coalesce``'s sort (or a stable one): sorted rows, the permutation, and where each new
    row begins."""
    sorted_rows, order = torch.sort(lookups, stable=stable)
    is_first = torch.ones_like(sorted_rows, dtype=torch.bool)
    torch.ne(sorted_rows[1:], sorted_rows[:-1], out=is_first[1:])
    return sorted_rows, order, is_first


def _flat_values(grad: Tensor) -> Tensor:
    values = grad._values()
    return values.reshape(values.shape[0], -1)


def coalesce_rows(grad: Tensor) -> tuple[Tensor, Tensor]:
    """The unique rows of a row-sparse COO gradient, ascending, and their summed values.

    Bit for bit what ``grad.coalesce()`` gives (same sort, duplicates added in the same
    order), in a quarter of its time: one gather of each row's first lookup and one
    ``index_add_`` of the remaining duplicates, instead of coalesce's per-lookup copy loop.
    Values come back as ``(U, W)``.
    """
    if grad.dtype in (torch.float16, torch.bfloat16):
        # coalesce rounds to half precision after every addition; index_add_ would
        # accumulate duplicates in float32 and round once, which is not SparseAdam.
        grad = grad.coalesce()
    values = _flat_values(grad)
    lookups = grad._indices()[0]
    if grad.is_coalesced():
        return lookups, values
    return sum_duplicate_rows(lookups, values)


def sum_duplicate_rows(lookups: Tensor, values: Tensor, *, stable: bool = False) -> tuple[Tensor, Tensor]:
    """The unique ``lookups``, ascending, and their summed ``values`` rows, each row's
    duplicates added first to last in the order of ``coalesce``'s sort, or with ``stable`` in
    the order they are given."""
    sorted_rows, order, is_first = _sort_lookups(lookups, stable=stable)
    rows = sorted_rows[is_first]
    summed = values.index_select(0, order[is_first])
    if rows.numel() < lookups.numel():
        is_dup = ~is_first
        # index_add_ adds in index order: ((first + second) + third) ..., as coalesce does
        summed.index_add_(0, is_first.cumsum(0)[is_dup] - 1, values.index_select(0, order[is_dup]))
    return rows, summed


@dataclass
class RowGroups:
    """A row-sparse gradient's lookups grouped by row, not summed (input of the kernel).

    ``rows``: unique touched rows, ascending. ``values``: one contiguous ``(nnz, W)`` row
    per lookup. Row ``i``'s lookups are ``order[starts[i]:starts[i + 1]]``, in the order
    ``coalesce`` adds them; both are ``None`` for a coalesced gradient.
    """

    rows: Tensor
    values: Tensor
    starts: Tensor | None = None
    order: Tensor | None = None

    @classmethod
    def from_sparse(cls, grad: Tensor) -> RowGroups:
        values = _flat_values(grad).contiguous()
        lookups = grad._indices()[0]
        if grad.is_coalesced():
            return cls(lookups.contiguous(), values)
        sorted_rows, order, is_first = _sort_lookups(lookups)
        starts = torch.cat([is_first.nonzero().squeeze(1), lookups.new_tensor([lookups.numel()])])
        return cls(sorted_rows[is_first], values, starts, order)

    def split(self, parts: int) -> list[int]:
        """Row boundaries of ``parts`` ranges with about equal numbers of lookups."""
        num_rows = self.rows.numel()
        if self.starts is None:
            return [num_rows * k // parts for k in range(parts + 1)]
        targets = torch.linspace(0, int(self.starts[-1]), parts + 1).round().long()
        bounds = torch.searchsorted(self.starts, targets).tolist()
        bounds[0], bounds[-1] = 0, num_rows
        return bounds


class Workspace:
    """Reusable buffers and worker threads, so a step allocates (and page-faults) nothing."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[Tensor, ...]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def buffers(self, *shapes: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, ...]:
        """Empty tensors of these shapes, the same ones every time they are asked for."""
        key = (shapes, dtype)
        if key not in self._buffers:
            self._buffers[key] = tuple(torch.empty(shape, dtype=dtype) for shape in shapes)
        return self._buffers[key]

    def run(self, work: Callable[[int], None], parts: int) -> None:
        """``work(0) ... work(parts - 1)``, in parallel when ``parts > 1``.

        If a part raises, the parts not yet started are cancelled and the running ones are
        waited for before the first error is raised, so no thread writes after this returns.
        """
        if parts == 1:
            work(0)
            return
        if self._pool_size < parts:
            self.close_pool()
            self._pool = ThreadPoolExecutor(max_workers=parts, thread_name_prefix="dsa-rows")
            self._pool_size = parts
        futures = [self._pool.submit(work, k) for k in range(parts)]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            for future in futures:
                future.cancel()
            wait(futures)
            raise failed.exception()
        for future in futures:
            future.result()

    def close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool, self._pool_size = None, 0


@dataclass(frozen=True)
class AdamStep:
    """The hyper-parameters of one parameter's step ``step`` (its counter after the increment)."""

    step: int
    lr: float | Tensor
    beta1: float
    beta2: float
    eps: float
    maximize: bool

    @property
    def step_size(self) -> float | Tensor:
        """``lr * sqrt(1 - beta2^t) / (1 - beta1^t)``; tensor arithmetic for a tensor lr, as in torch."""
        return self.lr * math.sqrt(1 - self.beta2**self.step) / (1 - self.beta1**self.step)


def fused_sparse_adam_rows_(
    kernel,
    moments: Tensor,
    groups: RowGroups,
    adam: AdamStep,
    workspace: Workspace,
    *,
    param: Tensor | None,
    out: Tensor | None,
) -> None:
    """The update with the compiled kernel: moments in place, then ``param`` or ``out``.

    ``moments`` is ``(N, 2, W)`` with contiguous ``(2, W)`` records, or the ``m|v`` view of a
    table's ``(N, 3, W)`` records (``stride(0) == 3 * W``).

    ``param`` (a CPU tensor whose rows are contiguous) receives the update at ``groups.rows``;
    or, with ``param=None``, ``out`` (``(U, W)``, contiguous) receives the updates in order.
    """
    dtype, width = moments.dtype, moments.shape[2]
    num_rows = groups.rows.numel()
    neg_step_size = -float(adam.step_size)
    parts = max(1, min(torch.get_num_threads(), num_rows // MIN_ROWS_PER_THREAD))
    bounds = groups.split(parts)
    chunk = max(1, FUSED_CHUNK_ELEMENTS // max(1, width))
    buffers = workspace.buffers(*[(chunk * width,)] * (2 * parts), dtype=dtype)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    rows, starts, order, values = ptr(groups.rows), ptr(groups.starts), ptr(groups.order), ptr(groups.values)
    target, target_stride, out_ptr = ptr(param), (param.stride(0) if param is not None else 0), ptr(out)

    def run(part: int) -> None:
        new_m, new_v = buffers[2 * part], buffers[2 * part + 1]
        for begin in range(bounds[part], bounds[part + 1], chunk):
            end = min(begin + chunk, bounds[part + 1])
            kernel.moments(
                dtype,
                moments.data_ptr(),
                rows,
                starts,
                order,
                values,
                begin,
                end,
                width,
                moments.stride(0),
                1 - adam.beta1,
                1 - adam.beta2,
                int(adam.maximize),
                new_m.data_ptr(),
                new_v.data_ptr(),
            )
            sqrt_v = new_v[: (end - begin) * width]
            torch.sqrt(sqrt_v, out=sqrt_v)
            kernel.apply(
                dtype,
                target,
                target_stride,
                out_ptr,
                rows,
                begin,
                end,
                width,
                new_m.data_ptr(),
                new_v.data_ptr(),
                adam.eps,
                neg_step_size,
            )

    workspace.run(run, parts)


def sparse_adam_rows_(
    moments: Tensor,
    rows: Tensor,
    grad: Tensor,
    apply_update: Callable[[int, Tensor, Tensor], None],
    adam: AdamStep,
    workspace: Workspace,
) -> None:
    """The update with torch operations, on chunks of rows that fit in the CPU cache.

    Updates ``moments`` (``(N, 2, W)``: m, v) in place at ``rows`` (unique, ascending);
    ``grad`` is their ``(U, W)`` summed gradient (see :func:`coalesce_rows`).
    ``apply_update(begin, rows, update)`` receives, chunk by chunk, the parameter update of
    ``rows[begin:begin + len(update)]`` (the caller adds it to the parameter).
    """
    step_size = adam.step_size
    neg_step_size = -step_size.cpu() if isinstance(step_size, Tensor) else -step_size
    width = moments.shape[2]
    chunk = max(16, CHUNK_BYTES // max(1, 2 * width * moments.dtype.itemsize))
    records, m_inc, v_inc = workspace.buffers((chunk, 2, width), (chunk, width), (chunk, width), dtype=moments.dtype)
    for begin in range(0, rows.numel(), chunk):
        end = min(begin + chunk, rows.numel())
        n = end - begin
        chunk_rows = rows[begin:end]
        g = grad[begin:end]
        record = torch.index_select(moments, 0, chunk_rows, out=records[:n])
        m, v = record[:, 0], record[:, 1]
        if adam.maximize:  # (-g) - m == -(g + m) exactly
            d_m = torch.add(g, m, out=m_inc[:n]).neg_()
        else:
            d_m = torch.sub(g, m, out=m_inc[:n])
        m.add_(d_m.mul_(1 - adam.beta1))
        d_v = torch.mul(g, g, out=v_inc[:n]).sub_(v).mul_(1 - adam.beta2)
        new_v = torch.add(v, d_v, out=v_inc[:n])  # contiguous: sqrt is 2x faster on it
        v.copy_(new_v)
        moments.index_put_((chunk_rows,), record)
        denom = new_v.sqrt_().add_(adam.eps)
        update = torch.div(m, denom, out=m_inc[:n]).mul_(neg_step_size)
        apply_update(begin, chunk_rows, update)


def compact_adam_rows_(
    m_store: Tensor,
    v_store: Tensor,
    rows: Tensor,
    grad: Tensor,
    apply_update: Callable[[int, Tensor, Tensor], None],
    adam: AdamStep,
) -> None:
    r"""Adam on a smaller state: ``m_store`` ``(N, W)`` in bfloat16 (or the parameter's dtype),
    ``v_store`` ``(N, W)`` or ``(N, 1)`` (row-wise), updated in place at ``rows``.

    With a row-wise second moment the row's elements share one :math:`v_r`:

    .. math::
        v_r \leftarrow v_r + (1 - \beta_2)\Big(\tfrac{1}{W}\textstyle\sum_j g_{rj}^2 - v_r\Big)

    The step uses :math:`m` before it is rounded to the stored dtype; ``grad`` is the rows'
    ``(U, W)`` summed gradient, ``apply_update`` as in :func:`sparse_adam_rows_`.
    """
    step_size = adam.step_size
    neg_step_size = -step_size.cpu() if isinstance(step_size, Tensor) else -step_size
    g = -grad if adam.maximize else grad
    for begin in range(0, rows.numel(), COMPACT_CHUNK_ROWS):
        chunk_rows = rows[begin : begin + COMPACT_CHUNK_ROWS]
        gc = g[begin : begin + COMPACT_CHUNK_ROWS]
        m = m_store.index_select(0, chunk_rows).to(gc.dtype)
        v = v_store.index_select(0, chunk_rows).to(gc.dtype)
        m.add_((gc - m).mul_(1 - adam.beta1))
        squared = gc * gc
        if v.shape[1] == 1 and gc.shape[1] != 1:
            squared = squared.mean(dim=1, keepdim=True)
        v.add_((squared - v).mul_(1 - adam.beta2))
        m_store.index_put_((chunk_rows,), m.to(m_store.dtype))
        v_store.index_put_((chunk_rows,), v.to(v_store.dtype))
        apply_update(begin, chunk_rows, (m / (v.sqrt() + adam.eps)).mul_(neg_step_size))


COMPACT_CHUNK_ROWS = 4096


def self_test(kernel) -> str:
    """Run the kernel and the torch path on one random case per dtype; describe a mismatch."""
    generator = torch.Generator().manual_seed(0)
    for dtype in kernel.dtypes:
        for maximize in (False, True):
            lookups = torch.randint(0, 40, (300,), generator=generator)
            values = torch.randn(300, 3, 5, generator=generator, dtype=dtype)
            grad = torch.sparse_coo_tensor(lookups[None], values, (50, 3, 5), check_invariants=False)
            moments = torch.rand(50, 2, 15, generator=generator, dtype=dtype)
            param = torch.randn(50, 3, 5, generator=generator, dtype=dtype)
            adam = AdamStep(step=3, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, maximize=maximize)
            expected_moments, expected_param = moments.clone(), param.clone()

            def add(begin, rows, update, target=expected_param):
                target.index_put_((rows,), target.index_select(0, rows).add_(update.view(-1, 3, 5)))

            workspace = Workspace()
            sparse_adam_rows_(expected_moments, *coalesce_rows(grad), add, adam, workspace)
            fused_sparse_adam_rows_(
                kernel, moments, RowGroups.from_sparse(grad), adam, workspace, param=param, out=None
            )
            workspace.close_pool()
            if not (torch.equal(moments, expected_moments) and torch.equal(param, expected_param)):
                return f"{dtype}, maximize={maximize}"
    return ""
