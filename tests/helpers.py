"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from dsa_train.train import loop


def assert_same_params(reference: torch.nn.Module, ours: torch.nn.Module, step: int) -> None:
    """Bit-for-bit equality: both optimizers must do the same float operations."""
    for (name, a), (_, b) in zip(reference.named_parameters(), ours.named_parameters()):
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            raise AssertionError(f"{name} differs after step {step}: max |diff| = {diff:.3e}")


@contextlib.contextmanager
def power_cut_at(step: int):
    """Inside the block, training raises "power cut" as it is about to take step ``step``
    (what came after the last checkpoint is lost, as in a crash); the step it wraps, the one in
    place on entry, is back after."""
    real_step = loop.Training.step

    def cut(self, picked):
        if self.step_count == step:
            raise RuntimeError("power cut")
        return real_step(self, picked)

    with mock.patch.object(loop.Training, "step", cut):
        yield
