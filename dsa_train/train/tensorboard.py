"""``output.tensorboard: true``: every metrics record also written as TensorBoard scalars.

metrics.jsonl stays the source of truth (``eval``, ``plot`` and resume read it); the event
files in ``<run>/tensorboard/`` are a copy for people who watch runs in TensorBoard, written by
torch's ``SummaryWriter`` (the ``tensorboard`` package must be installed: ``pip install
dsa-train[tensorboard]``). A resumed run purges the events after its checkpoint's step, as
it cuts metrics.jsonl back, so the curves do not fold back on themselves.

Tags: ``train/loss``, ``train/lr``, ``train/items_per_s``, ``epoch/loss``, ``epoch/items_per_s``, and per evaluation
``<split>/<group>/<metric>`` (``valid/both/mrr``, ``test/probe/accuracy``...), each at its step.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import DsaError


def _writer(folder: Path, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        raise DsaError(
            "output.tensorboard is true, but the tensorboard package is not installed",
            hint="pip install 'dsa-train[tensorboard]' (or tensorboard), or set output.tensorboard: false",
        ) from None
    return SummaryWriter(log_dir=str(folder), purge_step=purge_step)


def scalars(record: dict) -> list[tuple[str, float]]:
    """The (tag, value) pairs of one metrics record (see the module's docstring)."""
    kind = record.get("kind")
    if kind == "train":
        return [(f"train/{k}", record[k]) for k in ("loss", "lr", "items_per_s") if _number(record.get(k))]
    if kind == "epoch":
        return [(f"epoch/{k}", record[k]) for k in ("loss", "items_per_s") if _number(record.get(k))]
    if kind == "eval":
        return [
            (f"{record['split']}/{group}/{name}", value)
            for group, values in record.items()
            if isinstance(values, dict)
            for name, value in values.items()
            if _number(value)
        ]
    return []


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TensorBoardLog:
    """A :class:`~.run_folder.MetricsLog` that also writes each record's scalars as events."""

    def __init__(self, log, folder: Path, *, purge_step: int | None = None) -> None:
        self.log_file = log
        self.writer = _writer(folder, purge_step)

    @property
    def records(self) -> int:
        return self.log_file.records

    def log(self, record: dict) -> None:
        self.log_file.log(record)
        step = record.get("step")
        if isinstance(step, int):
            for tag, value in scalars(record):
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()
        self.log_file.close()
