#!/usr/bin/env python
"""What a checkpoint of a disk table costs: a delta of the changed rows vs writing just those
records vs today's full copy.

A disk table of ``--rows`` x ``--dim`` float32 rows (records [w | m | v]: 10^7 x 32 is a
3.8 GB file) is trained by DiskSparseAdam as a fresh run is, and its first checkpoint is
timed: a delta of the rows written since the table was made, on the initial table (no file
holds it: a resume draws it again from its seed), where it used to be a full copy; and so is
restoring the table from it, as ``--resume`` does. Then,
``--repeats`` times, ``--steps`` steps of a power-law batch (``--batch`` lookups) touch some rows, and three
things are timed, alternating on the same machine (the rows of a step are ``u^3 * rows`` for uniform u:
a power law, low ids hot, the same rows every round):

  (a) delta    ``CheckpointStore.save``: model and optimizer files, the table as a delta of the
               rows written since the previous checkpoint, gathered from the optimizer's memory
               (the live table is not flushed), digests, fsyncs, commit; and the bytes the
               block device wrote meanwhile, against the changed records' (the target: once);
  (b) records  the same record bytes (gathered beforehand) written with one sequential
               ``pwrite`` to a fresh file, then ``fsync``: the floor any checkpoint has;
  (c) full     a full copy of the table (a base; every first checkpoint was one before the
               initial table): ``copy_sparse`` of the whole file
               plus its digest, with the table's pages warm, and again after dropping them
               from the page cache (cold: what a table larger than RAM sees).

It prints each round and the medians' ratios delta/records (target <= 2) and full/delta.
With ``--profile``, one more round's delta checkpoint is taken apart after the timed rounds:
the wall time of each part (flushing the live files, torch files, gathering, writing and
fsyncing the delta, hashing it, digests read back, fsyncs of files and folders), nested as
they are called, the digest thread's hashing apart (it runs alongside).

    python scripts/bench_checkpoint.py                      # 10^7 rows: a 3.8 GB table
    python scripts/bench_checkpoint.py --rows 100000000     # 38 GB: needs ~42 GB free
    python scripts/bench_checkpoint.py --profile            # and where a delta checkpoint's time goes
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from dsa_train import DiskSparseAdam
from dsa_train.fsutil import copy_sparse, file_digest
from dsa_train.nn import DiskEmbedding
from dsa_train.storage.deltas import read_delta_header
from dsa_train.runs.checkpoint_rows import live_records
from dsa_train.runs.checkpoint_store import CheckpointStore, restore_row_file

from bench_long_run import block_device_stat, sectors_written


def power_law_batch(rows: int, batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, generator=g) ** 3 * rows).long()  # low ids hot, a long tail


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def write_records(data: bytes, target: Path) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view, offset = memoryview(data), 0
        while offset < len(view):
            offset += os.pwrite(fd, view[offset:], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def full_copy(table: Path, target: Path) -> None:
    copy_sparse(table, target)
    file_digest(target)


class Profile:
    """Wall time of wrapped functions, keyed by the chain of wrapped calls they were made in
    (per thread); installed for one checkpoint, then removed."""

    def __init__(self) -> None:
        self.totals: dict[tuple, float] = defaultdict(float)
        self.counts: dict[tuple, int] = defaultdict(int)
        self._stack = threading.local()
        self._undo: list = []

    def wrap(self, owner, name: str, label) -> None:
        real = getattr(owner, name, None) if owner is not None else None
        if real is None:  # not in this version of dsa-train
            return
        profile = self

        def timed_call(*args, **kwargs):
            stack = profile._stack.__dict__.setdefault("labels", ())
            name = label(*args) if callable(label) else label
            thread = threading.current_thread()
            if stack or thread is threading.main_thread():
                key = (*stack, name)
            else:  # alongside the main thread: apart, not in its sum
                key = (f"[{thread.name.rstrip('_0123456789')} thread] {name}",)
            profile._stack.labels = key
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                profile.totals[key] += time.perf_counter() - started
                profile.counts[key] += 1
                profile._stack.labels = stack

        setattr(owner, name, timed_call)
        self._undo.append((owner, name, real))

    def undo(self) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        self._undo = []

    def report(self, wall: float) -> str:
        lines = [f"profile of one delta checkpoint: {wall:.3f} s wall"]
        top = sum(t for key, t in self.totals.items() if len(key) == 1 and not key[0].startswith("["))
        for key in sorted(self.totals, key=lambda k: [(-self._total(k[: i + 1]), k[i]) for i in range(len(k))]):
            lines.append(f"  {'  ' * (len(key) - 1)}{self.totals[key]:7.3f} s  {key[-1]} ({self.counts[key]}x)")
        lines.append(f"  {wall - top:7.3f} s  the rest (Python, JSON, mkdir, rename, pruning: not wrapped)")
        return "\n".join(lines)

    def _total(self, key: tuple) -> float:
        return self.totals.get(key, 0.0)


def fsync_label(fd: int) -> str:
    path = os.readlink(f"/proc/self/fd/{fd}")
    if os.path.isdir(path):
        return "fsync: a folder"
    if path.endswith(".delta"):
        return "fsync: the delta"
    if "/checkpoints/" in path:
        return f"fsync: {os.path.basename(path)}"
    return f"fsync: live {os.path.basename(path)}"


def profiled_checkpoint(checkpoint) -> str:
    """Run ``checkpoint()`` with its parts timed; the report."""
    from dsa_train import fsutil
    from dsa_train.nn import DiskTable
    from dsa_train.storage import deltas, row_file, state_dir
    from dsa_train.runs import checkpoint_rows as ckpt
    from dsa_train.runs import optimizer_state as optimizers

    profile = Profile()
    profile.wrap(DiskSparseAdam, "flush", "DiskSparseAdam.flush (the live files)")
    profile.wrap(row_file.RowFile, "flush", "RowFile.flush: msync + fsync")
    profile.wrap(state_dir, "atomic_write_bytes", "manifest committed (temporary file, rename)")
    profile.wrap(DiskTable, "flush", "DiskTable.flush")
    profile.wrap(torch, "save", lambda obj, f, *a: f"torch.save {os.path.basename(str(f))}")
    profile.wrap(ckpt, "write_delta", "write_delta")
    profile.wrap(np, "take", "gather the records (np.take from the mapping)")
    profile.wrap(os, "write", "write()")
    profile.wrap(os, "fsync", fsync_label)
    profile.wrap(fsutil, "_start_writeback", "sync_file_range: start writeback")
    profile.wrap(getattr(fsutil, "StreamDigest", None), "update", "hash the delta as it is written")
    profile.wrap(ckpt, "_fsync_together", "fsync the files and folders together")
    profile.wrap(deltas, "copy_sparse", "copy_sparse")
    profile.wrap(optimizers, "copy_sparse", "copy the manifest")
    profile.wrap(optimizers, "_copy_small", "copy the manifest")
    profile.wrap(optimizers, "_write_new", "write the manifest a flush would commit")
    profile.wrap(row_file.RowFile, "copy_to", "RowFile.copy_to (a base from memory)")
    profile.wrap(ckpt, "copy_sparse", "copy_sparse (a base)")
    profile.wrap(ckpt, "file_digest", lambda path: f"file_digest {path.name} (read back)")
    profile.wrap(ckpt, "baseline", "read the previous checkpoint")
    try:
        wall = timed(checkpoint)
    finally:
        profile.undo()
    return profile.report(wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="steps between two checkpoints")
    parser.add_argument("--batch", type=int, default=16_384, help="lookups per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the table and checkpoints go (default: a temporary folder here)"
    )
    parser.add_argument("--profile", action="store_true", help="then take one more delta checkpoint apart")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir or Path.cwd()))
    try:
        run(args, root)
    finally:
        shutil.rmtree(root)


def run(args, root: Path) -> None:
    started = time.perf_counter()
    table = DiskEmbedding(args.rows, args.dim, path=root / "tables" / "entities.table", std=0.01)
    model = torch.nn.ModuleDict({"entities": table})
    size = table.path.stat().st_size
    print(
        f"table: {args.rows:,} x {args.dim} float32 [w|m|v] = {size / 1e9:.2f} GB, written in {time.perf_counter() - started:.1f} s"
    )
    checkpoints, step = root / "checkpoints", 0
    with DiskSparseAdam(model.named_parameters(), lr=0.01, state_dir=root / "state") as opt:
        CheckpointStore.count_from_creation(opt)  # as a fresh run does: the table is as Table.create made it

        def train() -> np.ndarray:
            nonlocal step
            touched = []
            for i in range(args.steps):
                rows = power_law_batch(args.rows, args.batch, seed=i)  # the same rows every round
                opt.zero_grad()
                table(rows).pow(2).sum().backward()
                opt.step()
                touched.append(rows.numpy())
                step += 1
            return np.unique(np.concatenate(touched))

        def checkpoint() -> Path:
            return CheckpointStore(checkpoints).save(step, model, opt, {"run_id": "bench", "step": step}, keep=2)

        first_rows = train()
        first = timed(checkpoint)
        written = read_delta_header(checkpoints / f"{step:010d}" / "tables" / "entities.table.delta")
        on_disk = sum(p.stat().st_blocks * 512 for p in (checkpoints / f"{step:010d}").rglob("*") if p.is_file())
        assert written["base"] == "initial" and written["rows"] == len(first_rows), written
        print(
            f"first checkpoint of the fresh run (a delta on the initial table: {written['rows']:,} rows): {first:.3f} s, "
            f"{on_disk / 1e6:.1f} MB on disk ({on_disk / size:.2%} of the table)"
        )
        restore = timed(
            lambda: restore_row_file(
                checkpoints / f"{step:010d}" / "tables" / "entities.table", root / "restored.table"
            )
        )
        (root / "restored.table").unlink()
        print(
            f"restoring the table from it (what --resume does: the table drawn again, the delta laid over it): {restore:.2f} s"
        )
        results = {"delta": [], "records": [], "full warm": [], "full cold": [], "disk written / records": []}
        device = block_device_stat(root)
        for round_ in range(args.repeats):
            rows = train()
            data = live_records(table)[rows].tobytes()  # the touched records, gathered before (b) is timed
            sectors = sectors_written(device)
            t_delta = timed(lambda: checkpoint())
            written = (sectors_written(device) - sectors) * 512 if device is not None else None
            delta = read_delta_header(checkpoints / f"{step:010d}" / "tables" / "entities.table.delta")
            assert delta["rows"] == len(rows), (delta["rows"], len(rows))
            results["disk written / records"].append(written / len(data) if written is not None else float("nan"))
            t_records = timed(lambda data=data, target=root / f"records-{round_}": write_records(data, target))
            t_warm = timed(lambda target=root / f"full-{round_}": full_copy(table.path, target))
            (root / f"full-{round_}").unlink()
            drop_cache(table.path)
            t_cold = timed(lambda target=root / f"full-{round_}": full_copy(table.path, target))
            (root / f"full-{round_}").unlink()
            (root / f"records-{round_}").unlink()
            for key, value in zip(results, (t_delta, t_records, t_warm, t_cold)):
                results[key].append(value)
            disk = (
                f"{written / 1e6:.1f} MB written to the disk during it"
                if written is not None
                else "the disk's writes unknown here"
            )
            print(
                f"round {round_ + 1}: {len(rows):,} rows touched ({len(data) / 1e6:.1f} MB of records, links {delta['links']}): "
                f"delta {t_delta:.3f} s ({disk}), records {t_records:.3f} s, full warm {t_warm:.2f} s, full cold {t_cold:.2f} s"
            )
        if args.profile:
            train()
            print(profiled_checkpoint(checkpoint))
    median = {key: statistics.median(values) for key, values in results.items()}
    print(
        f"medians: delta {median['delta']:.3f} s, records {median['records']:.3f} s, full {median['full warm']:.2f} s warm / "
        f"{median['full cold']:.2f} s cold; delta/records {median['delta'] / median['records']:.2f}x, "
        f"full/delta {median['full warm'] / median['delta']:.0f}x warm, {median['full cold'] / median['delta']:.0f}x cold; "
        f"the disk wrote {median['disk written / records']:.2f}x the changed records' bytes during a delta checkpoint"
    )


if __name__ == "__main__":
    main()
