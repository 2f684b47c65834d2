"""Run a command and report its peak memory: RssAnon (what RAM it really needs) and VmRSS
(which also counts mapped file pages, such as a disk table's, that the kernel reclaims under
pressure), sampled every 0.2 s from /proc, plus its wall time and exit status.

    python scripts/peak_memory.py dsa-train run recipes/synthetic-100m.yaml -o /tmp/run100m
"""

from __future__ import annotations

import subprocess
import sys
import time


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    started = time.time()
    process = subprocess.Popen(sys.argv[1:])
    peak = {"RssAnon": 0, "VmRSS": 0}
    while process.poll() is None:
        try:
            with open(f"/proc/{process.pid}/status") as f:
                for line in f:
                    field = line.split(":")[0]
                    if field in peak:
                        peak[field] = max(peak[field], int(line.split()[1]) * 1024)
        except OSError:  # it just ended
            pass
        time.sleep(0.2)
    mib = 2**20
    print(
        f"exit {process.returncode}, {time.time() - started:.0f} s, peak RssAnon {peak['RssAnon'] / mib:,.0f} MiB, "
        f"peak VmRSS {peak['VmRSS'] / mib:,.0f} MiB",
        file=sys.stderr,
    )
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
