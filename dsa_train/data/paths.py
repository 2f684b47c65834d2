"""Where a recipe's datasets live: the data root, the files ``dataset.path`` names (from the
current folder where they exist there, else under the data root), and the folder each dataset
is imported into.

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


def dataset_path(config: DatasetConfig, value: str) -> Path:
    """Where ``dataset.path`` (or ``dataset.labels``) is: an absolute path as it is; a relative
    one from the current folder where it exists there (a run stores it made absolute, see
    :func:`~dsa_train.recipe.with_data_root`), else under the data root."""
    path = Path(value)
    if path.is_absolute():
        return path
    if path.exists():
        return path.resolve()
    return data_root(config) / path


def places_looked(config: DatasetConfig, value: str) -> str:
    """Where :func:`dataset_path` looked for ``value``, for a "does not exist" message."""
    path = Path(value)
    if path.is_absolute():
        return f"'{path}'"
    return f"'{Path.cwd() / path}' (from the current folder) and '{data_root(config).resolve() / path}' (under the data root)"


def key_digest(key: object) -> str:
    """12 hex digits naming ``key`` (JSON, keys sorted): what tells import folders apart."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]


def import_target(config: DatasetConfig, slug: str, key: object) -> Path:
    """The folder a dataset is imported into: ``<data root>/imported/<slug>-<digest of key>``."""
    return imports_root(data_root(config)) / f"{slug}-{key_digest(key)}"
