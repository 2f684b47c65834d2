"""dsa-train: train huge sparse embedding tables on one machine."""

from .errors import DsaError, StateError
from .optim import DiskSparseAdam

__version__ = "0.1.0"
__all__ = ["DiskSparseAdam", "DsaError", "StateError", "__version__"]
