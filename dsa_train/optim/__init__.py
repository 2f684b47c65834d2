"""Optimizers whose state lives on disk. Knows nothing of models, recipes or the CLI."""

__all__ = ["DiskSparseAdam"]


def __getattr__(name: str):
    if name == "DiskSparseAdam":  # imported on first use, with torch (see dsa_train/__init__.py)
        from .disk_sparse_adam import DiskSparseAdam

        return DiskSparseAdam
    raise AttributeError(f"module 'dsa_train.optim' has no attribute {name!r}")
