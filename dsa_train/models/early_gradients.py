r"""A sum of loss terms whose gradient is taken term by term, as each term is computed.

Autograd keeps every intermediate of a loss until the backward pass. A step that scores ``Q``
queries against ``K`` shared candidates therefore holds its ``(Q, K)`` scores several times
over (about 8 such matrices: the scores, their intermediates, the loss's copies, their
gradients). When the loss is a sum of per-query terms, it can be computed a slice of queries
at a time with each slice's gradient taken at once, in the forward pass: a slice's
intermediates are freed before the next slice is scored, so at most one slice's are ever
held, and nothing is computed twice (activation checkpointing, the usual way, scores each
slice a second time in the backward pass).

The gradients reach the rest of the graph through a surrogate. With the terms
:math:`L = \sum_s \ell_s(x_s, c)` (``x_s`` a term's own inputs, ``c`` inputs every term shares,
such as the candidates' rows) and the gradients accumulated over the terms,
:math:`g_x = \partial L / \partial x`, the result is

.. math:: \tilde L = L + S - \operatorname{sg}(S), \qquad S = \sum_x \langle x, g_x \rangle,

where :math:`\operatorname{sg}` stops the gradient: :math:`\tilde L = L` in value and
:math:`\partial \tilde L / \partial x = g_x` exactly, so a backward pass from :math:`\tilde L`
(or from any linear function of it: a regulariser added, a scale) hands each input the
gradient the whole loss would have, the same sum taken in another order. A second derivative
(``create_graph``) is not available through it.

Measured on CPU (docs/performance.md, "A step's scores a slice at a time"): besides the memory,
slices of about 2M scores made a TransE step's loss 3x faster than one ``(4096, 8192)``
matrix, because glibc hands large freed blocks back to the kernel and the whole matrix's
blocks are faulted in afresh every step, while a slice's are reused from the heap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

#: A term: a function of its own inputs followed by the shared ones, and its own inputs.
Term = tuple[Callable[..., Tensor], Sequence[Tensor]]


def _leaf(x: Tensor) -> Tensor:
    """``x`` cut from its graph: a leaf that requires a gradient where ``x`` does."""
    return x.detach().requires_grad_(x.requires_grad)


def _add(total: Tensor | None, more: Tensor | None) -> Tensor | None:
    if more is None:
        return total
    return more if total is None else total + more


def sum_with_early_gradients(
    terms: Iterable[Term], shared: Sequence[Tensor] = (), params: Iterable[Tensor] = ()
) -> Tensor:
    """``sum(fn(*inputs, *shared) for fn, inputs in terms)``, each term's gradient taken as it is
    computed (module docstring). ``params``: tensors a term may use besides its inputs (a
    model's parameters); their gradients are handed on too. With autograd off (evaluation) the
    terms are simply summed."""
    if not torch.is_grad_enabled():
        return torch.stack([fn(*inputs, *shared) for fn, inputs in terms]).sum()
    shared_leaves = [_leaf(x) for x in shared]
    params = [p for p in params if p.requires_grad]
    shared_grads: list[Tensor | None] = [None] * len(shared)
    param_grads: list[Tensor | None] = [None] * len(params)
    total, handed = None, []  # the loss's value; <x, g> of each input with a gradient
    for fn, inputs in terms:
        leaves = [_leaf(x) for x in inputs]
        value = fn(*leaves, *shared_leaves)
        total = _add(total, value.detach())
        wrt = [x for x in leaves + shared_leaves if x.requires_grad] + params
        if not value.requires_grad or not wrt:
            continue
        grads = iter(torch.autograd.grad(value, wrt, allow_unused=True))
        for x, leaf in zip(inputs, leaves):
            g = next(grads) if leaf.requires_grad else None
            if g is not None:
                handed.append((x * g).sum())
        for i, leaf in enumerate(shared_leaves):
            if leaf.requires_grad:
                shared_grads[i] = _add(shared_grads[i], next(grads))
        for i in range(len(params)):
            param_grads[i] = _add(param_grads[i], next(grads))
    if total is None:
        raise ValueError("sum_with_early_gradients: no terms")
    handed += [(x * g).sum() for x, g in zip([*shared, *params], [*shared_grads, *param_grads]) if g is not None]
    if not handed:
        return total
    surrogate = torch.stack(handed).sum()
    return total + (surrogate - surrogate.detach())
