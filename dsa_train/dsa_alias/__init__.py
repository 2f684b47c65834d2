"""``dsa``: the seed's name for dsa-train's public objects, so code written as the seed writes
it (``from dsa import DiskSparseAdam``) runs unchanged.

A thin alias: every name is ``dsa_train``'s own object (``dsa.DiskSparseAdam is
dsa_train.DiskSparseAdam``), imported on first use as ``dsa_train`` imports it. Installed as the
top-level package ``dsa`` (pyproject.toml maps it to this folder).
"""

import dsa_train

__all__ = list(dsa_train.__all__)


def __getattr__(name: str):
    if name in __all__:
        return getattr(dsa_train, name)
    raise AttributeError(f"module 'dsa' has no attribute {name!r} (it aliases dsa_train's: {', '.join(__all__)})")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
