#!/usr/bin/env python
"""DiskSparseAdam against torch's SparseAdam on a busy machine: training time and CPU time
next to a CPU-bound neighbour, an I/O-bound neighbour, both, or none.

Each measurement is one optimizer training the recipe in a fresh process with a fresh
temporary run folder (the child of ``bench_throughput.py``: same seed, same batches, whole
steps timed after ``--warmup`` untimed ones), while the condition's neighbours run:

    none     nothing else started
    cpu      a process multiplying 1024 x 1024 matrices with torch in a loop (torch's default
             thread count)
    io       a process writing a 256 MB file (``--io-mb``) and fsyncing it, over and over, in a
             temporary folder on the file system of the run folders (``--dir``)
    cpu+io   both

Neighbours start (and are seen working) before the measured process starts and are stopped
after it ends, a fresh set for each measurement, always stopped and their files always removed
(also on an error or Ctrl-C). Repeats alternate which optimizer goes first. For each condition
the script prints both optimizers' wall time and process CPU time (every thread) of the timed
steps, what the neighbours got done meanwhile, and the dsa / sparse_adam ratios with their
spread over the repeats, against the targets: DiskSparseAdam's training time and CPU time at
most 1.2x SparseAdam's under each neighbour.

    python scripts/bench_contention.py                       # quickstart, every condition, 3 repeats
    python scripts/bench_contention.py --conditions none,cpu --repeats 5
    python scripts/bench_contention.py --recipe recipes/fb15k237-transe.yaml --steps 300
"""

from __future__ import annotations

import argparse
import json
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_throughput import KINDS, spawn_child, spread  # the same child training, one optimizer a process

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("none", "cpu", "io", "cpu+io")
TARGET = 1.2  # dsa / sparse_adam, for training time and for CPU time
NEIGHBOUR_PREFIX = "dsa-bench-neighbour-"

# A neighbour: argv is kind, folder (its temporary folder: also what tells its processes
# apart), io_mb. It prints one JSON line once it is working, and one with what it got done
# when stopped (SIGTERM, SIGINT, or its parent dying); the io neighbour removes its file.
NEIGHBOUR = r"""
import json, os, signal, sys, time
kind, folder, io_mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
parent = os.getppid()
class Stop(BaseException):
    pass
def stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Stop
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
try:  # told by the kernel when the parent dies (Linux), so that it never outlives it
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except Exception:
    pass
path = os.path.join(folder, "neighbour-io.bin")
done, began, ready = 0, time.perf_counter(), False
def say(**what):
    print(json.dumps(what), flush=True)
try:
    if kind == "cpu":
        import torch
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        a @ b
        say(ready=True, threads=torch.get_num_threads())
        began = time.perf_counter()
        while os.getppid() == parent:
            a @ b
            done += 1
    else:
        chunk = os.urandom(8 << 20)
        while os.getppid() == parent:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for _ in range(max(1, (io_mb << 20) // len(chunk))):
                    os.write(fd, chunk)
                    if not ready:
                        say(ready=True)
                        ready, began = True, time.perf_counter()
                    done += len(chunk)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(path)
except Stop:
    pass
finally:
    try:
        os.unlink(path)
    except OSError:
        pass
    if os.getppid() != parent:  # orphaned: the parent cannot remove the folder now; the last one out does
        try:
            os.rmdir(folder)
        except OSError:
            pass
    seconds = time.perf_counter() - began
    if kind == "cpu":
        say(kind=kind, matmuls=done, seconds=seconds, matmuls_per_s=done / max(seconds, 1e-9))
    else:
        say(kind=kind, written_mb=done / (1 << 20), seconds=seconds, mb_per_s=done / (1 << 20) / max(seconds, 1e-9))
"""


class Neighbours:
    """The neighbour processes of one condition, around one measurement (a context manager):
    started and working on entry; on exit stopped (SIGTERM, then SIGKILL), reaped, and their
    temporary folder removed, whatever happened meanwhile. ``report`` holds what each did."""

    def __init__(self, condition: str, base: Path, io_mb: int) -> None:
        self.kinds = [] if condition == "none" else condition.split("+")
        self.base, self.io_mb = base, io_mb
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.errors: list = []
        self.folder: Path | None = None
        self.report: dict[str, dict] = {}

    def __enter__(self) -> Neighbours:
        try:
            if self.kinds:
                self.folder = Path(tempfile.mkdtemp(prefix=NEIGHBOUR_PREFIX, dir=self.base))
            for kind in self.kinds:
                errors = tempfile.TemporaryFile()  # unlinked already: never left behind, never fills a pipe
                self.errors.append(errors)
                process = subprocess.Popen(
                    [sys.executable, "-c", NEIGHBOUR, kind, str(self.folder), str(self.io_mb)],
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    text=True,
                )
                self.processes.append((kind, process))
                self._wait_ready(kind, process, errors)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, p in self.processes]

    @staticmethod
    def _wait_ready(kind: str, process: subprocess.Popen, errors, timeout: float = 120.0) -> None:
        readable, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if readable else ""  # its only line until it is stopped
        if not line.startswith("{"):
            errors.seek(0)
            said = errors.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"the {kind} neighbour did not start within {timeout:.0f} s: {line!r}\n{said}")

    def stop(self) -> None:
        try:
            for _, process in self.processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)  # it removes its file and says what it did
            for kind, process in self.processes:
                try:
                    out, _ = process.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    out, _ = process.communicate()
                lines = [line for line in out.splitlines() if line.startswith("{")]
                if lines:
                    self.report[kind] = json.loads(lines[-1])
        finally:  # whatever interrupted the above: none survives, nothing stays on disk
            for _, process in self.processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for errors in self.errors:
                errors.close()
            self.errors = []
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder = None


def measure(condition: str, kind: str, args) -> dict:
    with Neighbours(condition, args.dir, args.io_mb) as neighbours:
        pids = neighbours.pids
        result = spawn_child(kind, args.recipe, args.overrides, steps=args.steps, warmup=args.warmup, folder=args.dir)
    return {**result, "neighbours": neighbours.report, "neighbour_pids": pids}


def neighbour_work(results: list[dict]) -> str:
    """What the neighbours got done while these measurements ran (medians)."""
    parts = []
    cpu = [r["neighbours"]["cpu"]["matmuls_per_s"] for r in results if "cpu" in r["neighbours"]]
    io = [r["neighbours"]["io"]["mb_per_s"] for r in results if "io" in r["neighbours"]]
    if cpu:
        parts.append(f"{statistics.median(cpu):.1f} matmuls/s")
    if io:
        parts.append(f"{statistics.median(io):.0f} MB/s written and fsynced")
    return ", ".join(parts)


def verdict(r: dict) -> str:
    if r["max"] <= TARGET:
        return "met"
    if r["median"] <= TARGET:
        return "met by the median, not in every repeat"
    return "MISSED"


def summarise(measurements: list[dict], conditions: list[str]) -> dict:
    summary = {}
    for condition in conditions:
        mine = [m for m in measurements if m["condition"] == condition]
        repeats = sorted({m["repeat"] for m in mine})
        by = {(m["repeat"], m["kind"]): m for m in mine}
        pairs = [(by[r, "dsa"], by[r, "sparse_adam"]) for r in repeats if (r, "dsa") in by and (r, "sparse_adam") in by]
        entry = {
            kind: {
                f: statistics.median(m[f] for m in mine if m["kind"] == kind)
                for f in ("wall_s", "cpu_s", "items_per_s", "median_step_ms")
            }
            for kind in KINDS
        }
        entry["ratio"] = {
            "wall": spread([d["wall_s"] / s["wall_s"] for d, s in pairs]),
            "cpu": spread([d["cpu_s"] / s["cpu_s"] for d, s in pairs]),
        }
        entry["target"] = {key: verdict(value) for key, value in entry["ratio"].items()}
        entry["neighbour_work"] = {kind: neighbour_work([m for m in mine if m["kind"] == kind]) for kind in KINDS}
        summary[condition] = entry
    if "none" in summary:  # how much each neighbour slows each optimizer down
        for entry in summary.values():
            for kind in KINDS:
                entry[kind]["wall_vs_none"] = entry[kind]["wall_s"] / summary["none"][kind]["wall_s"]
                entry[kind]["cpu_vs_none"] = entry[kind]["cpu_s"] / summary["none"][kind]["cpu_s"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--recipe", type=Path, default=ROOT / "recipes" / "quickstart.yaml", help="default: quickstart (no download)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=600,
        help="timed steps per measurement (default 600: meant as 20-40 s of quickstart on 2 cores)",
    )
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument(
        "--conditions", default=",".join(CONDITIONS), help=f"comma-separated, of {', '.join(CONDITIONS)}"
    )
    parser.add_argument("--repeats", type=int, default=3, help="measurements per condition and optimizer")
    parser.add_argument("--io-mb", type=int, default=256, help="size of the io neighbour's file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override key=value")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the run folders and the io neighbour's file go (one file system)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    args = parser.parse_args()
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or not conditions:
        parser.error(f"unknown condition(s) {', '.join(unknown) or '(none given)'}; pick from {', '.join(CONDITIONS)}")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.io_mb < 8:
        parser.error("--steps and --repeats must be at least 1, --warmup at least 0, --io-mb at least 8")
    args.dir = args.dir.resolve()
    args.dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the clean-up in the finally blocks

    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    measurements = []
    for repeat in range(args.repeats):
        for c, condition in enumerate(conditions):
            order = KINDS if (repeat + c) % 2 == 0 else KINDS[::-1]
            for kind in order:
                m = measure(condition, kind, args)
                measurements.append({"repeat": repeat, "condition": condition, **m})
                if len(measurements) == 1:
                    say(
                        f"{m['recipe']}: {m['epoch_items']:,} {m['unit']} per epoch, batch {m['batch']}, dim {m['dim']}; "
                        f"{m['steps']} timed steps after {m['warmup']} untimed; torch {m['torch']}, {m['threads']} threads, "
                        f"{m['cpus']} CPUs; run folders and io neighbour in {args.dir}\n"
                        f"each measurement: one optimizer in a fresh process with a fresh run folder (the optimizer state "
                        f"starts cold), fresh neighbours; {args.repeats} repeat{'s' * (args.repeats != 1)} alternating which optimizer goes first"
                    )
                say(
                    f"  repeat {repeat + 1} {condition:7s} {kind:12s} wall {m['wall_s']:7.2f} s  CPU {m['cpu_s']:7.2f} s  "
                    f"{m['items_per_s']:9,.0f} {m['unit']}/s  {neighbour_work([m])}"
                )
    summary = summarise(measurements, conditions)
    if args.json:
        print(
            json.dumps(
                {
                    "recipe": str(args.recipe),
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "repeats": args.repeats,
                    "conditions": conditions,
                    "io_mb": args.io_mb,
                    "overrides": args.overrides,
                    "dir": str(args.dir),
                    "target": TARGET,
                    "measurements": measurements,
                    "summary": summary,
                },
                indent=2,
            )
        )
        return
    print(
        f"medians over {args.repeats} repeat{'s' * (args.repeats != 1)}; targets: dsa / sparse_adam <= {TARGET:.1f}x "
        f"for training time and for CPU time"
    )
    for condition in conditions:
        entry = summary[condition]
        print(f"{condition}:")
        for kind in KINDS:
            e = entry[kind]
            slower = (
                f"  ({e['wall_vs_none']:.2f}x the wall, {e['cpu_vs_none']:.2f}x the CPU of none)"
                if "wall_vs_none" in e and condition != "none"
                else ""
            )
            work = f"  neighbours: {entry['neighbour_work'][kind]}" if entry["neighbour_work"][kind] else ""
            print(f"  {kind:12s} wall {e['wall_s']:7.2f} s  CPU {e['cpu_s']:7.2f} s{slower}{work}")
        for key, name in (("wall", "training time"), ("cpu", "CPU time")):
            r = entry["ratio"][key]
            print(
                f"  dsa / sparse_adam {name:13s} {r['median']:.2f}x (repeats {r['min']:.2f}-{r['max']:.2f})  "
                f"target <= {TARGET:.1f}x: {entry['target'][key]}"
            )


if __name__ == "__main__":
    main()
