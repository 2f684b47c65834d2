r"""A seeded synthetic knowledge graph that scales to 10^8 entities.

Entity popularity follows a power law: the entity of popularity rank :math:`k` is drawn with
probability :math:`\propto (k + 1)^{-s}` (``zipf`` = :math:`s`), and ranks are scattered over
the ids by the bijection :math:`k \mapsto (a k + c) \bmod N`, so hot entities are not
neighbours. Entity :math:`e` belongs to cluster :math:`e \bmod C`. Each relation links a
random source cluster to a random target cluster: its heads are popular entities of the
source cluster and its tails popular entities of the target cluster (with probability
``noise``, any entity). Like the typed relations of real knowledge graphs, this is
something TransE and DistMult can learn, so link prediction is far better than chance.

Triples are generated in chunks straight into the on-disk dataset format, in memory bounded
by a budget whatever the size: each chunk's triples go to partition files by a hash of the
triple; each partition is deduplicated alone (a fact is a fact once); the valid and test
triples are the ``valid + test`` triples of smallest seeded hash priority (a uniform sample
without a global shuffle), the first ``valid`` of them by priority the valid ones.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import DatasetError
from ..progress import work
from ..recipe import SyntheticConfig
from .fingerprint import hash_columns
from .store import DatasetWriter, partition_count

CHUNK = 1 << 20
GENERATOR_VERSION = 2  # 2: chunked into the dataset format, held-out triples by hash priority
ROW_BYTES = 24  # a triple in the scratch partitions: three int64


def power_law_ids(num_ids: int, count: int, generator: torch.Generator, zipf: float) -> torch.Tensor:
    """``count`` ids in ``[0, num_ids)``, power-law distributed, hot ids scattered."""
    if zipf == 0:
        return torch.randint(0, num_ids, (count,), generator=generator)
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    if abs(zipf - 1.0) < 1e-9:
        ranks = torch.exp(u * math.log(num_ids + 1)).floor_() - 1
    else:  # inverse CDF of the continuous power law on [1, N + 1)
        top = (num_ids + 1) ** (1 - zipf)
        ranks = ((top - 1) * u + 1).pow(1 / (1 - zipf)).floor_() - 1
    ranks = ranks.long().clamp_(0, num_ids - 1)
    a = 2654435761
    while math.gcd(a, num_ids) != 1:
        a += 2
    return (ranks * a + 12345) % num_ids


def write_synthetic_knowledge_graph(
    writer: DatasetWriter, *, config: SyntheticConfig, memory_bytes: int = 256 << 20
) -> None:
    """Generate the graph into ``writer`` (see the module docstring)."""
    generator = torch.Generator().manual_seed(config.seed)
    n, clusters = config.entities, min(config.clusters, config.entities)
    source = torch.randint(0, clusters, (config.relations,), generator=generator)
    target = torch.randint(0, clusters, (config.relations,), generator=generator)
    scratch = writer.path(".scratch")
    scratch.mkdir()
    count = partition_count(config.triples * ROW_BYTES * 4, memory_bytes)  # a partition's rows and sort temporaries
    bits = count.bit_length() - 1
    parts = [open(scratch / f"part-{p}", "wb") for p in range(count)]
    try:
        for start in range(0, config.triples, CHUNK):
            size = min(CHUNK, config.triples - start)
            relation = torch.randint(0, config.relations, (size,), generator=generator)
            head = _into_cluster(power_law_ids(n, size, generator, config.zipf), source[relation], clusters, n)
            tail = _into_cluster(power_law_ids(n, size, generator, config.zipf), target[relation], clusters, n)
            noisy = torch.rand(size, generator=generator) < config.noise
            tail[noisy] = torch.randint(0, n, (int(noisy.sum()),), generator=generator)
            triples = torch.stack([head, relation, tail], 1).numpy()
            partition = (
                (_priority(triples, 0) >> np.uint64(64 - bits)).astype(np.uint16) if bits else np.zeros(size, np.uint16)
            )
            order = np.argsort(partition, kind="stable")
            bounds = np.searchsorted(partition[order], np.arange(count + 1))
            for p in np.flatnonzero(np.diff(bounds)).tolist():
                parts[p].write(triples[order[bounds[p] : bounds[p + 1]]].tobytes())
            work("generating triples", start + size, config.triples)
    finally:
        for f in parts:
            f.close()
    held_out = config.valid + config.test
    smallest = np.empty(0, np.uint64)  # the held_out smallest priorities seen so far
    for p in range(count):  # pass 1: deduplicate each partition; find the held-out priority bound
        unique = _unique_rows(np.fromfile(scratch / f"part-{p}", np.int64).reshape(-1, 3))
        unique.tofile(scratch / f"part-{p}")
        priority = _priority(unique, config.seed + 1)
        if held_out and len(priority) > held_out:
            priority = np.partition(priority, held_out - 1)[:held_out]
        smallest = np.sort(np.concatenate([smallest, priority]))[:held_out]
        work("deduplicating", p + 1, count)
    if len(smallest) < held_out:
        raise DatasetError(
            f"the synthetic graph has only {len(smallest):,} distinct triples, not more than valid + test ({held_out:,})",
            hint="raise dataset.synthetic.triples or entities, or lower valid and test",
        )
    threshold = smallest[-1] if held_out else None
    dtype = np.int32 if max(n, config.relations) < 2**31 else np.int64
    train = writer.appender("train", dtype, (3,))
    held = []
    for p in range(count):  # pass 2: the held-out triples aside, the rest appended to train
        unique = np.fromfile(scratch / f"part-{p}", np.int64).reshape(-1, 3)
        priority = _priority(unique, config.seed + 1)
        out = priority <= threshold if threshold is not None else np.zeros(len(unique), bool)
        held.append((priority[out], unique[out]))
        train.append(unique[~out])
        (scratch / f"part-{p}").unlink()
    priority = np.concatenate([h[0] for h in held])
    rows = np.concatenate([h[1] for h in held]).reshape(-1, 3)[np.argsort(priority, kind="stable")]
    writer.put("valid", rows[: config.valid].astype(dtype))
    writer.put("test", rows[config.valid : held_out].astype(dtype))
    if len(rows) > held_out:  # priorities tied at the bound (a 2^-64 event): the extra ones train
        train.append(rows[held_out:])
    scratch.rmdir()
    writer.meta.update(num_entities=n, num_relations=config.relations, names=False)


def _into_cluster(ids: torch.Tensor, cluster: torch.Tensor, clusters: int, n: int) -> torch.Tensor:
    """Move each id to the given cluster (id mod clusters), keeping it near its popularity."""
    moved = ids - ids % clusters + cluster
    return torch.where(moved >= n, moved - clusters, moved)


def _priority(triples: np.ndarray, seed: int) -> np.ndarray:
    """A seeded 64-bit hash of each ``(head, relation, tail)`` row."""
    return hash_columns([triples[:, 0], triples[:, 1], triples[:, 2]], seed)


def _unique_rows(rows: np.ndarray) -> np.ndarray:
    """The distinct rows, sorted (head, relation, tail)."""
    if not len(rows):
        return rows
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    keep = np.ones(len(rows), bool)
    keep[1:] = (rows[1:] != rows[:-1]).any(1)
    return rows[keep]
