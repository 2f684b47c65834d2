#!/usr/bin/env python
"""Build the on-disk filter index from chunks and look queries up in it (issue 12).

1. Builds the index of ``--triples`` uniform random triples (E = ``--entities``, R =
   ``--relations``), generated in chunks of 2^20 rows and never held whole, and reports the
   build time, the peak RSS the build added (VmHWM, reset before it through
   /proc/self/clear_refs where the kernel allows) against the bytes of the triples as int32,
   and the bytes of the index on disk.
2. Times ``known`` for batches of 256 queries (tail and head, taken from the triples, so each
   has answers) on that memory-mapped index.
3. Compares with the old in-RAM index (sorted keys ``(h R + r) E + t``, two of them) on
   ``--compare-triples`` triples whose relations stay below the largest R that key can hold
   (``(2^63 - 1) // E^2``: 922 at E = 10^8), alternating batches between the two in one run,
   checking that both answer the same, and reporting the ratio of the medians.

    python scripts/bench_triple_index.py [--triples 20000000] [--entities 100000000]
        [--relations 1000] [--compare-triples N (default: --triples)] [--memory-mib 256] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dsa_train.data.triple_index import TripleIndex, write_triple_index

CHUNK = 1 << 20
BATCH = 256


def generated(count: int, entities: int, relations: int, seed: int):
    """A function that yields the same ``count`` triples in chunks every time it is called."""

    def chunks():
        g = np.random.default_rng(seed)
        for start in range(0, count, CHUNK):
            k = min(CHUNK, count - start)
            dtype = np.int32 if entities <= 1 << 31 else np.int64
            yield np.stack(
                [
                    g.integers(0, entities, k, dtype=dtype),
                    g.integers(0, relations, k, dtype=dtype),
                    g.integers(0, entities, k, dtype=dtype),
                ],
                1,
            )

    return chunks


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def vm_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class OldIndex:
    """The replaced in-RAM index, verbatim: two sorted int64 key tensors (h R + r) E + t."""

    def __init__(self, triples: torch.Tensor, num_entities: int, num_relations: int) -> None:
        h, r, t = triples[:, 0], triples[:, 1], triples[:, 2]
        self.num_entities, self.num_relations = num_entities, num_relations
        self._keys = {
            "tail": torch.sort((h * num_relations + r) * num_entities + t).values,
            "head": torch.sort((t * num_relations + r) * num_entities + h).values,
        }

    def known(self, anchor, relation, side):
        keys = self._keys[side]
        base = (anchor * self.num_relations + relation) * self.num_entities
        lo = torch.searchsorted(keys, base)
        hi = torch.searchsorted(keys, base + self.num_entities)
        counts = hi - lo
        query = torch.repeat_interleave(torch.arange(len(anchor)), counts)
        offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        entity = keys[lo[query] + offsets] - base[query]
        return query, entity


def query_batches(chunks, batches: int, seed: int):
    """``batches`` batches of 256 (anchor, relation, side) queries taken from the first chunk."""
    first = torch.from_numpy(next(iter(chunks())).astype(np.int64))
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batches):
        rows = first[torch.randint(0, len(first), (BATCH,), generator=g)]
        side = ("tail", "head")[i % 2]
        anchor = rows[:, 0] if side == "tail" else rows[:, 2]
        out.append((anchor, rows[:, 1], side))
    return out


def same_answers(new: tuple, old: tuple) -> bool:
    """Whether both give the same (query, entity) pairs: the old index keeps a triple generated
    twice as two keys (on a small E x R the generator repeats some), the new one once."""
    pairs = lambda found: torch.unique(torch.stack(found, 1), dim=0)  # noqa: E731
    return torch.equal(pairs(new), pairs(old))


def timed(index, batch) -> tuple[float, tuple]:
    start = time.perf_counter()
    found = index.known(*batch)
    return time.perf_counter() - start, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triples", type=int, default=20_000_000)
    parser.add_argument("--entities", type=int, default=100_000_000)
    parser.add_argument("--relations", type=int, default=1000)
    parser.add_argument("--compare-triples", type=int, default=None, help="default: --triples")
    parser.add_argument("--memory-mib", type=int, default=256)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--dir", type=Path, default=None, help="where to build (default: a temporary folder in .)")
    args = parser.parse_args()
    E, R = args.entities, args.relations
    work = Path(tempfile.mkdtemp(prefix="bench-triple-index-", dir=args.dir or Path.cwd()))
    try:
        chunks = generated(args.triples, E, R, seed=0)
        triple_bytes = args.triples * 3 * 4
        rss_before = vm_rss()
        exact_peak = reset_peak()
        hwm_before = vm_hwm()
        start = time.perf_counter()
        write_triple_index(work / "main", chunks, E, R, memory_bytes=args.memory_mib << 20)
        build = time.perf_counter() - start
        added = vm_hwm() - hwm_before
        disk = sum(p.stat().st_size for p in (work / "main").iterdir())
        index = TripleIndex.open(work / "main")
        print(
            f"build: {args.triples:,} triples, E = {E:,}, R = {R:,}: {build:.1f} s ({args.triples / build / 1e6:.2f} M triples/s), "
            f"{index.rows:,} distinct"
        )
        print(
            f"  peak RSS added by the build: {added / 2**20:.0f} MiB (budget {args.memory_mib} MiB; RSS before {rss_before / 2**20:.0f} MiB"
            f"{'' if exact_peak else ', VmHWM not resettable here: an upper bound'}, "
            f"ru_maxrss {__import__('resource').getrusage(__import__('resource').RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB); "
            f"the triples as int32: {triple_bytes / 2**20:.0f} MiB; ratio {added / triple_bytes:.2f}"
        )
        print(f"  index on disk: {disk / 2**20:.0f} MiB ({disk / index.rows:.1f} bytes per distinct triple)")
        times = [timed(index, batch)[0] for batch in query_batches(chunks, args.batches, seed=1)]
        print(
            f"  lookup, memory-mapped, page cache warm: {statistics.median(times) * 1e3:.3f} ms per batch of {BATCH} (median of {len(times)})"
        )

        # the old in-RAM index, where its key still fits: relations below (2^63 - 1) // E^2
        r_old = min(R, ((1 << 63) - 1) // (E * E))
        if r_old < 1:
            print(f"compare: skipped, the old key cannot hold even one relation at E = {E:,}")
            return
        args.compare_triples = args.compare_triples or args.triples
        compare = generated(args.compare_triples, E, r_old, seed=2)
        write_triple_index(work / "compare", compare, E, r_old, memory_bytes=args.memory_mib << 20)
        new = TripleIndex.open(work / "compare")
        old = OldIndex(torch.from_numpy(np.concatenate(list(compare())).astype(np.int64)), E, r_old)
        new_times, old_times = [], []
        for i, batch in enumerate(query_batches(compare, args.batches, seed=3)):
            pair = [(new, new_times), (old, old_times)]
            for index_, times_ in pair if i % 2 else pair[::-1]:  # alternate which goes first
                seconds, found = timed(index_, batch)
                times_.append(seconds)
                if index_ is new:
                    new_found = found
                else:
                    old_found = found
            assert same_answers(new_found, old_found), "the two indexes disagree"
        n_new, n_old = statistics.median(new_times), statistics.median(old_times)
        print(
            f"compare: {args.compare_triples:,} triples, E = {E:,}, R = {r_old:,} (the old key's limit), same answers: "
            f"new on disk {n_new * 1e3:.3f} ms, old in RAM {n_old * 1e3:.3f} ms per batch of {BATCH}; ratio new/old {n_new / n_old:.2f}"
        )
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
