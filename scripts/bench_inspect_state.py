#!/usr/bin/env python
"""How fast and how small `dsa-train inspect-state` stays as the state directory grows.

Builds state directories of 1M and 10M rows x 128 (1 GB and 10 GB apparent, sparse: only
100,000 random rows written), then times `dsa-train inspect-state DIR --json` (and with
--stats) in fresh processes, reporting wall time and peak resident memory of each.

    python scripts/bench_inspect_state.py [--rows 1000000 10000000] [--dim 128]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dsa_train.storage.format import LAYOUT
from dsa_train.storage.state_dir import StateDirectory


def build(path: Path, rows: int, dim: int, touched: int) -> None:
    store = StateDirectory(path)
    try:
        store.open({"entity.weight": ((rows, dim), "float32", None, LAYOUT)})
        moments = store.files["entity.weight"].moments
        picked = torch.randint(0, rows, (touched,), generator=torch.Generator().manual_seed(0)).unique()
        moments.index_copy_(0, picked, torch.rand(len(picked), 2, dim))
        store.steps["entity.weight"] = 1
        store.flush()
    finally:
        store.close()


def measure(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one command, started from a small launcher process.

    (A child forked straight from this process would count this process's pages, torch and
    all, in its peak RSS until it execs.)
    """
    launcher = (
        "import resource, subprocess, sys, time\n"
        "t = time.perf_counter(); r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
        "print(r.returncode, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run(
        [sys.executable, "-c", launcher, *args], capture_output=True, text=True, check=True
    ).stdout.split()
    if out[0] != "0":
        raise SystemExit(f"{' '.join(args)} failed with exit code {out[0]}")
    return float(out[1]), float(out[2]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--touched", type=int, default=100_000, help="rows written in each state directory")
    parser.add_argument("--dir", default=None, help="where to build them (default: the temp dir)")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "dsa_train"]  # this interpreter's dsa_train, on PATH or not
    print(f"{'rows':>12} {'apparent':>10} {'on disk':>9} {'inspect-state':>22} {'inspect-state --stats':>24}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for rows in args.rows:
            path = Path(tmp) / f"state-{rows}"
            build(path, rows, args.dim, args.touched)
            row_file = path / "entity.weight.rows"
            apparent, allocated = row_file.stat().st_size, row_file.stat().st_blocks * 512
            plain = measure([*cli, "inspect-state", str(path), "--json"])
            stats = measure([*cli, "inspect-state", str(path), "--json", "--stats"])
            print(
                f"{rows:>12,} {apparent / 2**30:>8.2f}GB {allocated / 2**20:>7.0f}MB "
                f"{plain[0]:>8.2f} s {plain[1]:>7.0f} MiB {stats[0]:>10.2f} s {stats[1]:>7.0f} MiB"
            )
            shutil.rmtree(path)


if __name__ == "__main__":
    main()
