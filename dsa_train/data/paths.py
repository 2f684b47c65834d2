"""Where a recipe's datasets live: the data root, and the folder each dataset is imported into.

Every dataset is imported once under ``<data root>/imported/`` (:func:`.store.imports_root`),
in a folder named by a slug and a digest of what identifies it, so another dataset, or the
same one from another folder, never lands in the same place.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..recipe import DatasetConfig
from .store import imports_root


def data_root(config: DatasetConfig) -> Path:
    """The recipe's ``dataset.root``, else ``$DSA_DATA_ROOT``, else ``./datasets``."""
    return Path(config.root or os.environ.get("DSA_DATA_ROOT") or "datasets")


def key_digest(key: object) -> str:
    """12 hex digits naming ``key`` (JSON, keys sorted): what tells import folders apart."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]


def import_target(config: DatasetConfig, slug: str, key: object) -> Path:
    """The folder a dataset is imported into: ``<data root>/imported/<slug>-<digest of key>``."""
    return imports_root(data_root(config)) / f"{slug}-{key_digest(key)}"
