"""Helpers shared by the tests."""

from __future__ import annotations

import torch


def assert_same_params(reference: torch.nn.Module, ours: torch.nn.Module, step: int) -> None:
    """Bit-for-bit equality: both optimizers must do the same float operations."""
    for (name, a), (_, b) in zip(reference.named_parameters(), ours.named_parameters()):
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            raise AssertionError(f"{name} differs after step {step}: max |diff| = {diff:.3e}")
