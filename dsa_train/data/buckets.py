r"""A knowledge graph's entities in partitions and its training triples in edge buckets, for
partition-ordered training (``train.order: partitioned``).

:class:`EntityPartitions` splits :math:`N` entities into :math:`P` partitions of
:math:`B = \lceil N / P \rceil` *slots*: entity ``id`` has slot :math:`s = \pi(\mathrm{id})`
(a seeded permutation, :class:`~.order.Shuffle`'s, computed on demand in both directions, so
the hot low ids of a power-law graph spread over every partition) and lies in partition
:math:`\lfloor s / B \rfloor`. With :math:`P = 1` the permutation is the identity: one
partition needs no balancing, and the run is then the random order's, row for row. A disk
table laid out by slot holds each partition as one contiguous range of records, read and
written whole (see :class:`~dsa_train.storage.buffer.PartitionBuffer`).

The training triple :math:`(h, r, t)` lies in bucket :math:`(p(h), p(t))`, numbered
:math:`p(h) P + p(t)`. :func:`load_buckets` writes the training split sorted by bucket
(stably: a bucket keeps the split's order) once, in the on-disk dataset format beside the
imported graph, with ``offsets`` (:math:`P^2 + 1`) where each bucket starts; later runs map it.
The sort is a counting sort in blocks, so memory stays bounded by a block at any size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..progress import work
from .kg import KnowledgeGraph
from .order import Shuffle
from .paths import key_digest
from .store import DatasetWriter, import_folder

BUCKETS_VERSION = 1  # what a buckets folder holds: bump it when that changes
BLOCK_ROWS = 1 << 20  # training triples sorted at once


class EntityPartitions:
    """The layout of ``num_entities`` entities in ``partitions`` partitions for ``seed``."""

    def __init__(self, num_entities: int, partitions: int, seed: int, *, permute_one: bool = False) -> None:
        """``permute_one``: permute the ids with one partition too (a torchrun job's row
        sharding does, so its layout is the same whatever the number of ranks)."""
        if num_entities <= 0 or partitions <= 0:
            raise ValueError(f"partitions need entities, got {num_entities} entities in {partitions} partitions")
        self.num_entities, self.partitions, self.seed = num_entities, partitions, seed
        self.block = -(-num_entities // partitions)
        self._order = Shuffle(num_entities, seed) if partitions > 1 or permute_one else None  # slot -> id

    def slots(self, ids: Tensor) -> Tensor:
        """The slot (table row) of each entity id, shaped like ``ids``."""
        if self._order is None:
            return ids.long()
        return self._order.position_of(ids.reshape(-1).cpu().long()).view(ids.shape).to(ids.device)

    def ids(self, slots: Tensor) -> Tensor:
        """The entity id at each slot, shaped like ``slots``."""
        if self._order is None:
            return slots.long()
        return self._order(slots.reshape(-1).cpu().long()).view(slots.shape).to(slots.device)

    def partition_of(self, ids: Tensor) -> Tensor:
        return torch.div(self.slots(ids), self.block, rounding_mode="floor")

    def span(self, partition: int) -> tuple[int, int]:
        """The slots ``[first, stop)`` of ``partition`` (the last may hold fewer, or none)."""
        first = min(partition * self.block, self.num_entities)
        return first, min(first + self.block, self.num_entities)

    def _extents(self, partitions: Tensor) -> tuple[Tensor, Tensor]:
        """The first slot and the slot count of each of ``partitions`` (see :meth:`span`)."""
        firsts = torch.clamp(partitions * self.block, max=self.num_entities)
        return firsts, torch.clamp(firsts + self.block, max=self.num_entities) - firsts

    def count(self, partitions: Tensor) -> int:
        """How many slots ``partitions`` hold together."""
        return int(self._extents(partitions)[1].sum())

    def spread(self, partitions: Tensor, offsets: Tensor) -> Tensor:
        """The slots at ``offsets`` (each in ``[0, count(partitions))``) of the slots of
        ``partitions`` laid end to end: uniform offsets are uniform rows of the partitions."""
        firsts, sizes = self._extents(partitions)
        ends = torch.cumsum(sizes, 0)
        which = torch.searchsorted(ends, offsets, right=True)
        return firsts[which] + offsets - (ends[which] - sizes[which])

    def key(self) -> dict:
        return {"entities": self.num_entities, "partitions": self.partitions, "seed": self.seed}


@dataclass
class Buckets:
    """The training triples sorted by bucket (``(M, 3)``, entity ids as in the graph) and
    ``offsets``: bucket ``b = p(h) P + p(t)`` is ``triples[offsets[b] : offsets[b + 1]]``."""

    partitions: EntityPartitions
    triples: Tensor
    offsets: Tensor
    folder: Path | None = None  # where they are on disk (None: built in memory)


def bucket_of(partitions: EntityPartitions, triples: Tensor) -> Tensor:
    """The bucket of each ``(h, r, t)`` row (or ``(u, v)`` pair): by its first and last ids."""
    heads, tails = partitions.partition_of(triples[:, 0].long()), partitions.partition_of(triples[:, -1].long())
    return heads * partitions.partitions + tails


def sorted_into_buckets(partitions: EntityPartitions, rows: Tensor, bucket: Tensor) -> Buckets:
    """``rows`` sorted stably by their ``bucket`` (:func:`bucket_of`), in memory."""
    order = torch.sort(bucket, stable=True)
    counts = torch.bincount(order.values, minlength=partitions.partitions**2)
    return Buckets(partitions, rows[order.indices], _offsets(counts.numpy()))


def load_buckets(
    kg: KnowledgeGraph,
    partitions: EntityPartitions,
) -> Buckets:
    """The training split of ``kg`` in buckets: written beside its imported dataset on first
    use (and again if the graph is imported again), mapped afterwards; built in memory for a
    graph that lives in memory."""
    if kg.dataset is None:
        return sorted_into_buckets(partitions, kg.train, bucket_of(partitions, kg.train))
    parent = kg.dataset.folder
    sources = {
        "graph": hashlib.sha256(json.dumps(kg.dataset.manifest["sources"], sort_keys=True).encode()).hexdigest(),
        "layout": partitions.key(),
        "version": BUCKETS_VERSION,
    }
    folder = parent.with_name(f"{parent.name}.buckets-{partitions.partitions}-{key_digest(sources)}")

    def build(writer: DatasetWriter) -> None:
        _write_buckets(writer, kg, partitions)

    dataset = import_folder(
        folder,
        kind="buckets",
        name=f"{kg.name} in {partitions.partitions}x{partitions.partitions} buckets",
        sources=sources,
        build=build,
    )
    return Buckets(
        partitions, dataset.tensor("triples"), torch.from_numpy(np.asarray(dataset.array("offsets"))), dataset.folder
    )


def _offsets(counts: np.ndarray) -> Tensor:
    return torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))


def _write_buckets(writer: DatasetWriter, kg: KnowledgeGraph, partitions: EntityPartitions) -> None:
    """Counting sort of the training split by bucket, a block at a time: one pass counts, one
    pass writes each block's rows to their buckets' next free positions."""
    train, count = kg.train, len(kg.train)
    buckets = partitions.partitions**2
    what = f"sorting {count:,} training triples into {buckets:,} buckets"
    counts = np.zeros(buckets, np.int64)
    for start in range(0, count, BLOCK_ROWS):
        counts += np.bincount(bucket_of(partitions, train[start : start + BLOCK_ROWS]).numpy(), minlength=buckets)
        work(what, start // 2, count)
    offsets = _offsets(counts).numpy()
    out = writer.create("triples", (count, 3), train.numpy().dtype)
    cursor = offsets[:-1].copy()
    for start in range(0, count, BLOCK_ROWS):
        block = train[start : start + BLOCK_ROWS]
        bucket = bucket_of(partitions, block).numpy()
        order = np.argsort(bucket, kind="stable")
        sorted_bucket = bucket[order]
        first = np.searchsorted(sorted_bucket, sorted_bucket, side="left")  # where each row's bucket run starts
        out[cursor[sorted_bucket] + np.arange(len(order)) - first] = block.numpy()[order]
        cursor += np.bincount(bucket, minlength=buckets)
        work(what, (count + start) // 2, count)
    if count:
        out.flush()
    writer.put("offsets", offsets)
    writer.meta.update(partitions.key(), num_triples=count)
    work(what, count, count)
