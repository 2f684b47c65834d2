"""What a training task gives the loop (see :mod:`.loop`): the base class every task extends.

A task is the data, model, batches, loss and metrics of one kind of training. An epoch is an
order over ``epoch_items()`` items (triples, nodes, edges or samples, counted in ``unit``);
``loss(picked)`` turns a batch of item numbers into a loss, drawing any randomness from torch's
global generator (which the loop seeds per step). What only some tasks need has a no-op default
here, so the loop calls it on every task: read-ahead of a disk table (``prefetch``), dense
weights, an order of its own (partition order), a buffer to report and close, gradients
computed across processes (a sharded task), per-query ranks to write.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor, nn

from ..data.order import Shuffle


class Task:
    """The base of every task; a subclass sets ``unit``, ``description`` and ``model`` and gives
    :meth:`sparse_parameters`, :meth:`epoch_items`, :meth:`loss`, :meth:`evaluate` and
    :meth:`headline`."""

    unit: str
    description: str
    model: nn.Module
    #: :meth:`write_ranks` writes the last evaluation's per-query ranks (``eval --save-ranks``)
    saves_ranks: bool = False

    def sparse_parameters(self) -> list[tuple[str, Tensor]]:
        """The embedding tables the recipe's optimizer trains, named."""
        raise NotImplementedError

    def dense_parameters(self) -> list[Tensor]:
        """Dense weights, trained with torch's Adam at ``optimizer.dense_lr`` (none by default)."""
        return []

    def epoch_items(self) -> int:
        raise NotImplementedError

    def epoch_order(self, seed: int, items: int):
        """The epoch's order: what ``slice(start, stop)`` of its batches are. By default a
        shuffle of the ``items`` items seeded with ``seed``, computed per batch."""
        return Shuffle(items, seed)

    def prefetch(self, picked: Tensor) -> None:
        """Told the next batch before this one's step, to start reading the rows of a disk
        table it will touch (called only with ``embedding_storage: disk``)."""

    def loss(self, picked: Tensor) -> Tensor:
        raise NotImplementedError

    def gradients(self, picked: Tensor) -> float:
        """Leave the step's gradients in the parameters' ``.grad`` and return its loss: the
        loss's backward here; a sharded task, whose backward involves other processes,
        computes them itself."""
        loss = self.loss(picked)
        loss.backward()
        return loss.item()

    def evaluate(self, split: str, *, final: bool) -> dict[str, dict]:
        raise NotImplementedError

    def headline(self, metrics: dict[str, dict]) -> str:
        raise NotImplementedError

    def write_ranks(self, path: Path) -> int:
        raise NotImplementedError(f"{type(self).__name__} keeps no per-query ranks")

    def buffer_summary(self) -> dict | None:
        """What the run summary says of a partition buffer (``None``: the task has none)."""
        return None

    def close(self) -> None:
        """Stop background work (reads, write-backs) before the optimizer closes."""
