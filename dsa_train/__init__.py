"""dsa-train: train huge sparse embedding tables on one machine."""

import logging

from .errors import ConfigError, DatasetError, DsaError, StateError, TrainingError

# The library's messages go through loggers under "dsa_train"; until the application
# configures logging, nothing is printed (not even warnings, as Python's last resort would).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "DatasetError",
    "DiskEmbedding",
    "DiskEmbeddingBag",
    "DiskSparseAdam",
    "DsaError",
    "StateError",
    "TrainingError",
    "__version__",
    "open_run",
    "run",
]


def __getattr__(name: str):
    # Imported on first use: torch takes seconds to import, and the CLI's light commands
    # (inspect-state, clean, recipes, validate, --help) never need it.
    if name == "DiskSparseAdam":
        from .optim.disk_sparse_adam import DiskSparseAdam

        return DiskSparseAdam
    if name in ("DiskEmbedding", "DiskEmbeddingBag"):
        from . import nn

        return getattr(nn, name)
    if name == "open_run":
        from .results import open_run

        return open_run
    if name == "run":
        from .entry import run

        return run
    raise AttributeError(f"module 'dsa_train' has no attribute {name!r}")
