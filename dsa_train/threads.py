"""How dsa-train's processes set up torch's thread pool: idle threads sleep instead of spinning.

torch's CPU operations run on an OpenMP team (libgomp in the pip wheels). By default an idle
team member spins 300,000 times before it sleeps, so that the next parallel region starts
sooner. On a box with few cores that other work shares (a Colab VM, a laptop, a 2-core CI
runner) the spinning threads take the cores from the threads that have work: a small model's
training slowed 2-5x, with as much CPU burnt, and its time swung 2-3x from run to run
(``scripts/bench_contention.py``; docs/performance.md). Not spinning at all
(``OMP_WAIT_POLICY=PASSIVE``) keeps the CPU time flat next to a CPU-bound neighbour (0.9x of a
quiet run, against 2.1x with a spin of 20,000 and more with the default), at a price on a quiet
machine, where each parallel region waits for its threads to wake: the quickstart trains in
10-11 s instead of 7-8 s (a dedicated box can set ``OMP_WAIT_POLICY=ACTIVE`` or
``GOMP_SPINCOUNT=20000``). The setting is read once, when torch loads its OpenMP runtime, so
it is put in the environment before torch is imported.
"""

from __future__ import annotations

import os
import sys

#: What dsa-train sets unless the user did (set ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` to choose).
DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
#: Variables by which a user already chose how idle threads wait.
CHOICES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def prefer_sleeping_threads() -> bool:
    """Apply :data:`DEFAULTS` to this process unless the user chose; ``False`` (nothing done)
    once torch is imported, or when the user's environment already says how threads wait."""
    if "torch" in sys.modules or any(os.environ.get(name) for name in CHOICES):
        return False
    os.environ.update(DEFAULTS)
    return True
