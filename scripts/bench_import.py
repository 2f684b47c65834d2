"""Importing a user's TSV knowledge graph: the streaming import against the parser dsa-train
had before it (a Python loop filling a list of tuples and two dicts of names), side by side
on the same generated files, each in a fresh process.

Prints, for each: wall seconds, peak RSS (VmHWM: everything resident, file pages included)
and peak anonymous RSS (sampled every 20 ms), and the ratio old / new; then the seconds a
second `load` takes (the import reused: what `run --resume` and `eval` pay).

The files (default: 5,000,000 entities, 200 relations, 20,000,000 train triples, ~650 MB of
text, like a Freebase extract) are generated once into --folder; entity popularity is skewed
(id = E * u^1.5). Regimes: the page cache is warm for both parsers after the first read
(the files fit in RAM here); a cold cache adds the same read time to both.

    python scripts/bench_import.py                      # the issue's size (~10 minutes)
    python scripts/bench_import.py --triples 2000000 --entities 500000   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

OLD_PARSER = r"""
import sys, time, torch
def read_triples(path, entities, relations):
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.endswith(b"\r\n"):
                raise ValueError(number)
            parts = raw.removesuffix(b"\n").decode("utf-8").split("\t")
            if len(parts) != 3 or not all(parts):
                raise ValueError(number)
            head, relation, tail = parts
            h = entities.setdefault(head, len(entities))
            r = relations.setdefault(relation, len(relations))
            rows.append((h, r, entities.setdefault(tail, len(entities))))
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)
entities, relations = {}, {}
splits = [read_triples(f"{sys.argv[1]}/{s}.txt", entities, relations) for s in ("train", "valid", "test")]
print(len(entities), len(relations), *[len(s) for s in splits])
"""

NEW_IMPORT = r"""
import sys
from dsa_train.data import load_knowledge_graph
from dsa_train.recipe import DatasetConfig
kg = load_knowledge_graph(DatasetConfig(kind="tsv", path=sys.argv[1]))
print(kg.num_entities, kg.num_relations, len(kg.train), len(kg.valid), len(kg.test))
"""

MEASURE = r"""
import os, runpy, sys, threading, time
peak = [0]
def sample():
    while True:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
started = time.perf_counter()
code = open(sys.argv[1]).read()
sys.argv = sys.argv[1:]
exec(compile(code, "bench", "exec"), {"__name__": "__main__"})
seconds = time.perf_counter() - started
with open("/proc/self/status") as f:
    hwm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
print("MEASURED", seconds, hwm, peak[0])
"""


def generate(folder: Path, entities: int, relations: int, triples: int, held_out: int, seed: int = 0) -> None:
    """Fixed-width Freebase-like names ('/m/0' + 7 base-32 digits, '/r/' + 4 digits): 32-byte lines."""
    rng = np.random.default_rng(seed)
    digits = np.frombuffer(b"0123456789bcdfghjklmnpqrstvwxyz_", np.uint8)

    def names(count: int, prefix: bytes, width: int, base: int) -> np.ndarray:
        out = np.empty((count, len(prefix) + width), np.uint8)
        out[:, : len(prefix)] = np.frombuffer(prefix, np.uint8)
        ids = np.arange(count)
        for k in range(width - 1, -1, -1):
            out[:, len(prefix) + k] = digits[ids % base] if base == 32 else 48 + ids % 10
            ids //= base
        return out

    entity_names, relation_names = names(entities, b"/m/0", 7, 32), names(relations, b"/r/", 4, 10)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", triples), ("valid", held_out), ("test", held_out)):
        with open(folder / f"{split}.txt", "wb") as f:
            for start in range(0, count, 1 << 20):
                n = min(1 << 20, count - start)
                h = (entities * rng.random(n) ** 1.5).astype(np.int64)
                t = (entities * rng.random(n) ** 1.5).astype(np.int64)
                r = rng.integers(0, relations, n)
                line = np.empty((n, 32), np.uint8)
                line[:, 0:11], line[:, 11] = entity_names[h], 9
                line[:, 12:19], line[:, 19] = relation_names[r], 9
                line[:, 20:31], line[:, 31] = entity_names[t], 10
                f.write(line.tobytes())


def measure(code: str, folder: Path, env: dict) -> dict:
    with (
        tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script,
        tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as runner,
    ):
        script.write(code)
        runner.write(MEASURE)
    try:
        result = subprocess.run(
            [sys.executable, runner.name, script.name, str(folder)], env=env, capture_output=True, text=True
        )
    finally:
        os.unlink(script.name)
        os.unlink(runner.name)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    lines = result.stdout.strip().splitlines()
    _, seconds, hwm, anon = lines[-1].split()
    return {"counts": lines[-2], "seconds": float(seconds), "peak_rss": int(hwm), "peak_anon": int(anon)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entities", type=int, default=5_000_000)
    parser.add_argument("--relations", type=int, default=200)
    parser.add_argument("--triples", type=int, default=20_000_000)
    parser.add_argument("--held-out", type=int, default=50_000)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "dsa-bench-import")
    parser.add_argument("--repeats", type=int, default=1, help="alternate old and new this many times")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    size = f"{args.entities}-{args.relations}-{args.triples}-{args.held_out}"
    data = args.folder / size
    if not (data / "test.txt").is_file():
        print(f"generating {args.triples:,} triples into {data} ...", file=sys.stderr)
        generate(data, args.entities, args.relations, args.triples, args.held_out)
    text_bytes = sum((data / f"{s}.txt").stat().st_size for s in ("train", "valid", "test"))
    repo = Path(__file__).resolve().parents[1]
    runs: dict[str, list[dict]] = {"old parser": [], "import": [], "second load": []}
    for _ in range(args.repeats):
        root = Path(tempfile.mkdtemp(prefix="dsa-bench-root-"))
        env = {**os.environ, "DSA_DATA_ROOT": str(root), "PYTHONPATH": str(repo)}
        try:
            runs["old parser"].append(measure(OLD_PARSER, data, env))
            runs["import"].append(measure(NEW_IMPORT, data, env))
            runs["second load"].append(measure(NEW_IMPORT, data, env))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    assert len({r["counts"] for rs in runs.values() for r in rs}) == 1, {
        k: [r["counts"] for r in v] for k, v in runs.items()
    }
    best = {name: min(rs, key=lambda r: r["seconds"]) for name, rs in runs.items()}
    report = {
        "text_bytes": text_bytes,
        "counts (entities relations train valid test)": best["import"]["counts"],
        **{name: {k: v for k, v in r.items() if k != "counts"} for name, r in best.items()},
        "speedup (old / import)": round(best["old parser"]["seconds"] / best["import"]["seconds"], 2),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    mib = 2**20
    print(f"{text_bytes / mib:,.0f} MiB of TSV; entities, relations, train, valid, test: {best['import']['counts']}")
    print(f"{'':14}{'seconds':>10}{'peak RSS MiB':>15}{'peak anon MiB':>15}")
    for name, r in best.items():
        print(f"{name:14}{r['seconds']:>10.1f}{r['peak_rss'] / mib:>15,.0f}{r['peak_anon'] / mib:>15,.0f}")
    print(f"import is {report['speedup (old / import)']}x faster than the old parser (best of {args.repeats})")


if __name__ == "__main__":
    main()
