#!/usr/bin/env python
"""What ``memory_budget`` bounds: the hard memory a DiskSparseAdam run holds above its table.

One process, a table of ``--rows`` x ``--dim`` float32 in RAM, ``--steps`` steps of ``--lookups``
uniformly random rows under ``--memory-budget``. A thread samples the process's hard memory
(RssAnon + RssShmem: what the kernel cannot drop without swap) every millisecond; the figures
are its peak above the level before the first step (the table and the optimizer built), split
into:

- the moments' changed pages the optimizer holds (by the kernel's page tables, after the last
  step): what the budget bounds;
- the rest: the step's own tensors (the gradient's rows and values, their coalesced copy, the
  kernel's chunk buffers), which come and go with each step.

Each figure is also given in "a step's rows" (lookups x dim x 4 bytes), the unit the docs use.

    python scripts/bench_budget.py --rows 4000000 --dim 128 --lookups 65536 --memory-budget 128MiB
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import torch

from dsa_train import DiskSparseAdam
from dsa_train.memory import rss_hard_bytes

MiB = 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--lookups", type=int, default=65_536)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--memory-budget", default="128MiB")
    p.add_argument("--state-dir", default=None, help="where the state lives (default: a temporary folder)")
    args = p.parse_args(argv)

    weight = torch.nn.Parameter(torch.zeros(args.rows, args.dim))
    with tempfile.TemporaryDirectory(dir=args.state_dir) as tmp:
        opt = DiskSparseAdam([("w", weight)], lr=1e-3, state_dir=f"{tmp}/state", memory_budget=args.memory_budget)
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, args.rows, (args.lookups,), generator=g) for _ in range(2)]
        values = torch.randn(args.lookups, args.dim, generator=g)
        before = rss_hard_bytes()
        peak, stop = before, threading.Event()

        def sample():
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, rss_hard_bytes())
                time.sleep(0.001)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        began = time.perf_counter()
        for step in range(args.steps):
            index = batches[step % 2] if step < 2 else torch.randint(0, args.rows, (args.lookups,), generator=g)
            weight.grad = torch.sparse_coo_tensor(index[None], values, weight.shape, check_invariants=False)
            opt.step()
            weight.grad = None
        seconds = (time.perf_counter() - began) / args.steps
        stop.set()
        sampler.join()
        held = opt.residency()
        opt.close()
    budget = held["memory_budget"]
    unit = args.lookups * args.dim * 4
    growth = peak - before
    moments = held["resident_bytes"]
    print(
        f"table {args.rows:,} x {args.dim}, {args.steps} steps of {args.lookups:,} rows, budget {budget / MiB:,.0f} MiB"
    )
    print(f"  a step's rows (lookups x dim x 4 bytes): {unit / MiB:,.1f} MiB; {seconds * 1e3:,.1f} ms a step")
    print(f"  peak hard memory above the start: {growth / MiB:,.1f} MiB ({growth / unit:.1f} step's rows)")
    print(f"  the moments' changed pages held after the last step: {moments / MiB:,.1f} MiB (<= the budget)")
    print(
        f"  above the budget at the peak: {(growth - budget) / MiB:,.1f} MiB ({(growth - budget) / unit:.1f} step's rows)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
