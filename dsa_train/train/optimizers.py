"""The recipe's optimizer: DiskSparseAdam or torch's SparseAdam, and how each is checkpointed.

DiskSparseAdam's moments live in the run's ``optimizer_state/``: a checkpoint flushes them
and copies the directory (holes stay holes), and a resume copies it back before the optimizer
opens it. SparseAdam's moments are tensors: they go into ``optimizer.pt``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import StateError
from ..fsutil import copy_sparse
from ..optim import DiskSparseAdam
from ..optim.format import MANIFEST, PENDING_SUFFIX, ROWS_SUFFIX
from ..optim.inspect import live_holder
from ..recipe import OptimizerConfig

STATE_COPY = "optimizer_state"
STATE_DICT = "optimizer.pt"


def build_optimizer(config: OptimizerConfig, named_parameters: list[tuple[str, torch.Tensor]], state_dir: Path) -> torch.optim.Optimizer:
    """The recipe's optimizer for sparse embedding tables (named, so DiskSparseAdam names its files)."""
    kwargs = dict(lr=config.lr, betas=config.betas, eps=config.eps)
    if config.kind == "dsa":
        return DiskSparseAdam(
            named_parameters, state_dir=state_dir, nonfinite=config.nonfinite,
            first_moment=config.first_moment, second_moment=config.second_moment, **kwargs,
        )  # fmt: skip
    return torch.optim.SparseAdam([p for _, p in named_parameters], **kwargs)


def snapshot_optimizer(optimizer: torch.optim.Optimizer, target: Path) -> None:
    """Write the optimizer's complete state into the checkpoint folder ``target``."""
    if isinstance(optimizer, DiskSparseAdam):
        optimizer.flush()
        copy = target / STATE_COPY
        copy.mkdir()
        for source in _state_files(optimizer.state_dir):
            copy_sparse(source, copy / source.name)
    torch.save(optimizer.state_dict(), target / STATE_DICT)


def restore_state_dir(checkpoint: Path | None, state_dir: Path) -> None:
    """Make the live state directory the checkpoint's copy again (before the optimizer opens
    it), or empty it when there is no checkpoint: what is there came after the checkpoint."""
    holder = live_holder(state_dir) if state_dir.exists() else None
    if holder:
        raise StateError(
            f"optimizer state directory '{state_dir}' is in use by {holder}",
            hint="another training uses it: stop that one, or give this run its own optimizer.state_dir",
        )
    if state_dir.exists():
        for stale in _state_files(state_dir):
            stale.unlink()
    copy = checkpoint / STATE_COPY if checkpoint is not None else None
    if copy is None or not copy.is_dir():
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    for source in _state_files(copy):
        copy_sparse(source, state_dir / source.name)


def load_optimizer_state(optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    optimizer.load_state_dict(torch.load(checkpoint / STATE_DICT, weights_only=False))


def close_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer, DiskSparseAdam):
        optimizer.close()


def _state_files(directory: Path) -> list[Path]:
    return [p for p in Path(directory).iterdir() if p.name == MANIFEST or p.name.endswith((ROWS_SUFFIX, PENDING_SUFFIX))]

