"""How dsa-train's processes set up torch's thread pool: spin briefly, then sleep, when idle.

torch's CPU operations run on an OpenMP team (libgomp in the pip wheels). By default an idle
team member spins 300,000 times before it sleeps, so that the next parallel region starts
sooner. On a box with few cores that other work shares (a Colab VM, a laptop, a 2-core CI
runner) the spinning threads take the cores from the threads that have work: a small model's
training slowed 2-5x, with as much CPU burnt, and its time swung 2-3x from run to run
(``scripts/bench_contention.py``; docs/performance.md). Not spinning at all
(``OMP_WAIT_POLICY=PASSIVE``) fixes that but makes the quiet case 1.5x slower, every parallel
region waiting for its threads to wake; a spin of 20,000 keeps the quiet speed and most of the
fix. The setting is read once, when torch loads libgomp, so it is put in the environment
before torch is imported. (A torch built with Intel's OpenMP reads ``KMP_BLOCKTIME`` instead.)
"""

from __future__ import annotations

import os
import sys

#: What dsa-train sets unless the user did (set ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` to choose).
DEFAULTS = {"GOMP_SPINCOUNT": "20000"}
#: Variables by which a user already chose how idle threads wait.
CHOICES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def prefer_short_spins() -> bool:
    """Apply :data:`DEFAULTS` to this process unless the user chose; ``False`` (nothing done)
    once torch is imported, or when the user's environment already says how threads wait."""
    if "torch" in sys.modules or any(os.environ.get(name) for name in CHOICES):
        return False
    os.environ.update(DEFAULTS)
    return True
