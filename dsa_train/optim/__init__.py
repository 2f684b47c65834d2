"""Optimizers whose state lives on disk. Knows nothing of models, recipes or the CLI."""

from .disk_sparse_adam import DiskSparseAdam

__all__ = ["DiskSparseAdam"]
