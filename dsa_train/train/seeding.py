"""The seeds a run's steps draw from: derived from the recipe's seed and the step, so that a
resumed run, or another rank, draws exactly what an uninterrupted one does."""

from __future__ import annotations

import torch


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step`` (an epoch's order uses ``-1 - epoch``) of a run seeded ``seed``."""
    return (seed * 1_000_003 + step) % (1 << 62)


def seed_step(seed: int) -> None:
    """Seed the generators a step draws from: what ``torch.manual_seed`` does for the CPU and
    CUDA, without its cost where CUDA is not initialised (there it records a stack trace for
    each lazy device, about 1 ms a call, which a 256-triple step on a small graph noticed)."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
