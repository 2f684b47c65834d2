"""What a training task gives the loop (see :mod:`.loop`), and the task a recipe asks for."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from ..recipe import Recipe


class Task(Protocol):
    """Data, model, batches, loss and metrics of one kind of training.

    An epoch is a shuffled pass over ``epoch_items()`` items (triples, nodes or edges,
    counted in ``unit``); ``loss(picked)`` turns a batch of item numbers into a loss, drawing
    any randomness from torch's global generator (which the loop seeds per step).
    """

    unit: str
    description: str
    model: nn.Module

    def sparse_parameters(self) -> list[tuple[str, Tensor]]: ...
    def dense_parameters(self) -> list[Tensor]: ...
    def epoch_items(self) -> int: ...
    def loss(self, picked: Tensor) -> Tensor: ...
    def evaluate(self, split: str, *, final: bool, reporter) -> dict[str, dict]: ...
    def headline(self, metrics: dict[str, dict]) -> str: ...


def make_task(recipe: Recipe, device: torch.device) -> Task:
    """The task for the recipe's model; builds its data and model (seed torch first)."""
    if recipe.is_kge:
        from .kge import KGETask

        return KGETask(recipe, device)
    if recipe.model.kind == "node2vec":
        from .node2vec import Node2VecTask

        return Node2VecTask(recipe, device)
    from .sage import SageTask

    return SageTask(recipe, device)
