"""How dsa-train's processes set up torch's thread pool: sleeping, not spinning, when idle.

torch's CPU operations run on an OpenMP team (libgomp in the pip wheels). By default an idle
team member spins for a while before it sleeps, so that the next parallel region starts a
few microseconds sooner. On a box with few cores that other work shares (a Colab VM, a
laptop, a 2-core CI runner) the spinning threads take the cores from the threads that have
work, and a training step of a small model slows by 2-5x, with the same CPU time burnt
(``scripts/bench_contention.py`` measures it; see docs/performance.md). The policy is read
once, when torch loads libgomp, so it is set in the environment before torch is imported.
"""

from __future__ import annotations

import os
import sys

#: What dsa-train sets unless the user did (``OMP_WAIT_POLICY=ACTIVE`` brings spinning back).
DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def prefer_sleeping_threads() -> bool:
    """Apply :data:`DEFAULTS` to this process; ``False`` (nothing done) once torch is imported."""
    if "torch" in sys.modules:
        return False
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    return True
