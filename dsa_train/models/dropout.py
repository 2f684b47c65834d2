r"""Dropout on the CPU with torch's own mask, drawn faster.

Dropout with rate :math:`p` keeps each coordinate with probability :math:`q = 1 - p` and
scales what it keeps by :math:`1 / q`: :math:`y = x \odot m / q`, :math:`m_i \sim
\mathrm{Bernoulli}(q)`, so that :math:`\mathbb{E}[y] = x`.

On the CPU, ``F.dropout`` draws :math:`m` with ``bernoulli_(q)``, which takes, coordinate by
coordinate, one double :math:`u` uniform in :math:`[0, 1)` from the default generator and keeps
the coordinate where :math:`u < q`. ``torch.rand(..., dtype=torch.float64)`` draws the same
doubles from the same generator in the same order, faster (figures in docs/results.md).
:func:`dropout` is therefore ``F.dropout`` bit for bit (the
output, its gradient, and the generator's state after it; ``tests/test_dropout.py`` holds it
to that), so a recipe trains as it did with torch's dropout, only faster. Off the CPU (CUDA's
fused kernel is fast), in evaluation, or at :math:`p \notin (0, 1)` it is ``F.dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``F.dropout(x, p, training)``, with the CPU mask drawn as above."""
    if not training or not 0 < p < 1 or x.device.type != "cpu" or not x.is_floating_point():
        return F.dropout(x, p, training)
    keep = 1 - p
    noise = (torch.rand(x.shape, dtype=torch.float64) < keep).to(x.dtype)
    noise.div_(keep)
    return x * noise


def seeded_mask(shape: tuple[int, ...], p: float, seed: int) -> Tensor:
    """Inverted dropout's mask, ``keep / (1 - p)``, drawn from its own generator seeded with
    ``seed`` (float32 uniforms, a coordinate kept where ``u >= p``): the same on every rank of a
    sharded run, whichever rank draws it. Not :func:`dropout`'s draw, which a one-process run
    keeps for its results to stay those of ``F.dropout``."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=generator) >= p).float() / (1 - p)
