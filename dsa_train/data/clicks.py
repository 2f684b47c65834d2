"""The click-log container for recommenders: per split, each impression's click label, dense
features and categorical features, mapped from its imported dataset.

Every click log (a TSV or CSV file, a generated one) is imported once into the on-disk
dataset format (:mod:`.store`, kind ``"clicks"``) and mapped from there by every later run,
``--resume`` or ``eval``. The arrays of each split ``s``::

    s_labels   (n,) uint8          1: the impression was clicked
    s_dense    (n, D) float32      the dense features (a click log's already log-transformed)
    s_bags     (n * F + 1,) int64  bag b = sample * F + feature holds ids[s_bags[b]:s_bags[b + 1]]
    s_ids      (nnz,) int64        categorical values: a generator's ids, or a file's 63-bit hashes
    s_weights  (nnz,) float32      each id's weight in its bag (only where the data has weights)
    s_logits   (n,) float32        generated data only: the true click logit (what the planted
                                   signal gives: the best any model can do)

A bag may be empty (a missing value). Nothing of size n is held in RAM: a batch gathers its
samples' rows from the mappings (:meth:`ClickLog.batch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .store import SPLITS, Dataset, DatasetWriter


@dataclass
class ClickBatch:
    """A batch of impressions: ``bags = len(labels) * features`` bags of ids, bag ``b`` being
    feature ``b % features`` of sample ``b // features``."""

    labels: Tensor  # (B,) float32, 0 or 1
    dense: Tensor  # (B, D) float32
    ids: Tensor  # (nnz,) int64 raw values, bag after bag
    feature: Tensor  # (nnz,) int64 the feature each id belongs to
    offsets: Tensor  # (B * F,) int64 where each bag starts in ids
    weights: Tensor | None  # (nnz,) float32 or None
    logits: Tensor | None  # (B,) float32 true logits (generated data) or None


@dataclass
class ClickLog:
    """A click log over memory-mapped, read-only arrays."""

    name: str
    features: list[str]  # categorical feature names
    dense_features: list[str]
    samples: dict[str, int]  # split -> impressions
    clicks: dict[str, int]  # split -> clicked impressions
    weighted: bool
    dataset: Dataset

    @property
    def num_features(self) -> int:
        return len(self.features)

    @property
    def num_dense(self) -> int:
        return len(self.dense_features)

    @property
    def has_logits(self) -> bool:
        return self.dataset.has("test_logits")

    def batch(self, split: str, samples: Tensor | np.ndarray) -> ClickBatch:
        """The impressions ``samples`` (positions in the split) gathered from the mappings."""
        picked = np.asarray(samples, dtype=np.int64)
        arrays = lambda name: self.dataset.array(f"{split}_{name}")  # noqa: E731
        f = self.num_features
        bags = (picked[:, None] * f + np.arange(f)).reshape(-1)
        bag_offsets = arrays("bags")
        starts, ends = bag_offsets[bags], bag_offsets[bags + 1]
        lengths = ends - starts
        offsets = np.zeros(len(bags), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        # position of each id in the split's arrays: its bag's start plus its place in the bag
        positions = np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
        feature = np.repeat(np.tile(np.arange(f, dtype=np.int64), len(picked)), lengths)
        weights = torch.from_numpy(arrays("weights")[positions].astype(np.float32)) if self.weighted else None
        logits = (
            torch.from_numpy(arrays("logits")[picked].astype(np.float32))
            if self.dataset.has(f"{split}_logits")
            else None
        )
        return ClickBatch(
            labels=torch.from_numpy(arrays("labels")[picked].astype(np.float32)),
            dense=torch.from_numpy(np.ascontiguousarray(arrays("dense")[picked], dtype=np.float32)),
            ids=torch.from_numpy(arrays("ids")[positions].astype(np.int64)),
            feature=torch.from_numpy(feature),
            offsets=torch.from_numpy(offsets),
            weights=weights,
            logits=logits,
        )

    @classmethod
    def of(cls, dataset: Dataset) -> ClickLog:
        meta = dataset.meta
        return cls(
            dataset.name,
            list(meta["features"]),
            list(meta["dense_features"]),
            {s: int(meta["samples"][s]) for s in SPLITS},
            {s: int(meta["clicks"][s]) for s in SPLITS},
            bool(meta["weighted"]),
            dataset,
        )

    def __str__(self) -> str:
        n = self.samples
        rate = self.clicks["train"] / max(n["train"], 1)
        return (
            f"{self.name}: {n['train']:,} / {n['valid']:,} / {n['test']:,} train / valid / test impressions "
            f"({rate:.1%} clicked), {self.num_features} categorical and {self.num_dense} dense features"
        )


class ClickWriter:
    """Writes a click log's arrays (see the module docstring) split by split, chunk by chunk,
    so a log far larger than RAM imports in bounded memory."""

    def __init__(
        self, writer: DatasetWriter, *, features: list[str], dense_features: list[str], weighted: bool
    ) -> None:
        self.writer, self.features, self.dense_features, self.weighted = writer, features, dense_features, weighted
        self.samples = dict.fromkeys(SPLITS, 0)
        self.clicks = dict.fromkeys(SPLITS, 0)
        self._ids = dict.fromkeys(SPLITS, 0)
        self._open: dict[str, dict] = {}

    def _appenders(self, split: str, logits: bool) -> dict:
        if split not in self._open:
            w = self.writer
            self._open[split] = {
                "labels": w.appender(f"{split}_labels", np.uint8),
                "bags": w.appender(f"{split}_bags", np.int64),
                "ids": w.appender(f"{split}_ids", np.int64),
                **({"dense": w.appender(f"{split}_dense", np.float32, (self.num_dense,))} if self.num_dense else {}),
                **({"weights": w.appender(f"{split}_weights", np.float32)} if self.weighted else {}),
                **({"logits": w.appender(f"{split}_logits", np.float32)} if logits else {}),
            }
            self._open[split]["bags"].append(np.zeros(1, np.int64))
        return self._open[split]

    @property
    def num_dense(self) -> int:
        return len(self.dense_features)

    def append(
        self,
        split: str,
        labels: np.ndarray,
        dense: np.ndarray,
        lengths: np.ndarray,
        ids: np.ndarray,
        weights: np.ndarray | None = None,
        logits: np.ndarray | None = None,
    ) -> None:
        """Append ``n`` impressions: ``lengths`` ``(n, F)`` ids per bag, ``ids`` (and
        ``weights``) the bags' ids in order, sample after sample."""
        out = self._appenders(split, logits is not None)
        out["labels"].append(labels.astype(np.uint8))
        if self.num_dense:
            out["dense"].append(dense)
        ends = self._ids[split] + np.cumsum(lengths.reshape(-1), dtype=np.int64)
        out["bags"].append(ends)
        out["ids"].append(ids)
        if self.weighted:
            out["weights"].append(weights)
        if logits is not None:
            out["logits"].append(logits)
        self._ids[split] = int(ends[-1]) if len(ends) else self._ids[split]
        self.samples[split] += len(labels)
        self.clicks[split] += int(labels.sum())

    def finish(self) -> None:
        """Create the arrays of splits that got no impression, and write the meta."""
        for split in SPLITS:
            self._appenders(split, False)
            if not self.num_dense:
                self.writer.create(f"{split}_dense", (self.samples[split], 0), np.float32)
        self.writer.meta.update(
            features=self.features,
            dense_features=self.dense_features,
            weighted=self.weighted,
            samples=self.samples,
            clicks=self.clicks,
        )
