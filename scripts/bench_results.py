#!/usr/bin/env python
"""What taking results out of a large run costs: export, exact top-k, a single query.

Trains a generated knowledge graph's TransE for one step (the weights are what they are: only
their size matters here) into ``--folder``, once per size, then measures, each in a fresh
process:

export    ``dsa-train export --format npy`` of the entity table: wall time, MB/s, peak
          anonymous memory (sampled every 20 ms), against writing the same bytes sequentially
          (``numpy.tofile`` in 64 MiB pieces and an fsync) in the same process just before and
          just after it: the disk's rate, which the page cache's state moves by 2x
predict   ``predict_many`` of ``--queries`` tail queries, top 10, exact, against the floor of that
          work measured in the same process: one pass over the entity rows (``chunks``) and
          the matrix product of the queries with each chunk
single    one query at ``--single-entities`` rows (default 10^6), after the run is open
ann       with ``--approximate`` (and nothing else): at ``--single-entities`` rows, for each faiss
          index type of ``--kinds``: build time (streamed from the table, recall measured),
          load time of the saved index, ``--queries`` neighbour queries one at a time and in
          one batch, and recall@10 over those queries, against the exact path in the same
          process (one exact query; the same queries' exact top 10 in one pass); then the
          batch time and recall at each search effort of ``--efforts``

    python scripts/bench_results.py                                     # 10^7 x 64 and 10^6 x 64
    python scripts/bench_results.py --entities 1000000 --queries 100    # a quick look
    python scripts/bench_results.py --approximate --kinds ivf,hnsw      # faiss at 10^6 x 64 (pip install "dsa-train[faiss]")
    python scripts/bench_results.py --approximate --single-entities 100000 --efforts 8,32,128,512   # recall against search effort
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RECIPE = """\
name: bench-results-{entities}
dataset:
  kind: synthetic
  synthetic: {{entities: {entities}, relations: 50, triples: {triples}, valid: 100, test: 100, clusters: 100, seed: 0}}
model: {{kind: transe, dim: {dim}, init_std: 0.1}}
train: {{epochs: 1, max_steps: 1, batch_size: 1024, negatives: 64, checkpoint_every: 0}}
optimizer: {{kind: dsa, lr: 0.01}}
eval: {{every_epochs: 0, final_splits: []}}
"""
MiB = 1 << 20


def make_run(folder: Path, entities: int, dim: int) -> Path:
    run = folder / f"run-{entities}x{dim}"
    if (run / "checkpoints").is_dir():
        return run
    recipe = folder / f"bench-results-{entities}.yaml"
    recipe.write_text(RECIPE.format(entities=entities, triples=2 * entities, dim=dim))
    env = dict(os.environ, DSA_DATA_ROOT=str(folder / "data"))
    subprocess.run([sys.executable, "-m", "dsa_train", "run", str(recipe), "-o", str(run)], check=True, env=env)
    return run


class PeakAnon:
    """Peak RssAnon of this process, sampled every 20 ms."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()

    def _read(self) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    def __enter__(self):
        self.base = self._read()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._read())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def child_export(run: Path, out: Path) -> dict:
    import numpy as np

    from dsa_train import open_run
    from dsa_train.results import export_run

    trained = open_run(run)
    rows, dim = trained.tables["entities"]
    size = rows * dim * 4
    piece = np.random.default_rng(0).standard_normal((64 * MiB) // 4, dtype=np.float32)
    pieces = -(-size // piece.nbytes)

    def sequential(name: str) -> float:
        t0 = time.perf_counter()
        with open(out / name, "wb") as f:
            for _ in range(pieces):
                piece.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        return (time.perf_counter() - t0) * size / (pieces * piece.nbytes)  # the time for the table's bytes

    before = sequential("sequential-before.bin")  # the page cache's state moves the disk's rate: measured on both sides
    with PeakAnon() as anon:
        t0 = time.perf_counter()
        export_run(trained, out / "export", "npy")
        export_s = time.perf_counter() - t0
    after = sequential("sequential-after.bin")
    sequential_s = (before + after) / 2
    return {
        "rows": rows,
        "dim": dim,
        "export_s": round(export_s, 1),
        "export_MBps": round(size / export_s / 1e6),
        "sequential_write_MBps_before_after": [round(size / before / 1e6), round(size / after / 1e6)],
        "export_vs_sequential": round(export_s / sequential_s, 2),
        "peak_anon_growth_MiB": round((anon.peak - anon.base) / MiB),
    }


def child_predict(run: Path, queries: int) -> dict:
    import torch

    from dsa_train import open_run

    trained = open_run(run)
    rows, _ = trained.tables["entities"]
    g = torch.Generator().manual_seed(0)
    heads = torch.randint(0, rows, (queries,), generator=g).tolist()
    relations = torch.randint(0, trained.tables["relations"][0] // 2, (queries,), generator=g).tolist()
    t0 = time.perf_counter()
    trained.predict_many([(h, r, None) for h, r in zip(heads, relations)], k=10)
    predict_s = time.perf_counter() - t0
    query = torch.randn(queries, trained.tables["entities"][1])
    t0 = time.perf_counter()
    for _, block in trained.chunks("entities"):
        query @ block.T
    floor_s = time.perf_counter() - t0
    return {
        "rows": rows,
        "queries": queries,
        "predict_s": round(predict_s, 2),
        "pass_and_matmul_s": round(floor_s, 2),
        "predict_vs_floor": round(predict_s / floor_s, 2),
    }


def child_single(run: Path) -> dict:
    t0 = time.perf_counter()
    from dsa_train import open_run

    trained = open_run(run)
    open_s = time.perf_counter() - t0
    times = []
    for head in range(3):
        t0 = time.perf_counter()
        trained.predict(head=head, relation=0, k=10)
        times.append(time.perf_counter() - t0)
    return {
        "rows": trained.tables["entities"][0],
        "open_s": round(open_s, 2),
        "single_query_s": [round(t, 3) for t in times],
    }


def child_ann(run: Path, queries: int, kinds: str, folder: Path, efforts: str) -> dict:
    import torch

    from dsa_train import open_run
    from dsa_train.results.ann import exact_top_k

    trained = open_run(run)
    rows, _ = trained.tables["entities"]
    metric = trained.default_metric
    asked = torch.randint(0, rows, (queries,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    trained.neighbors(int(asked[0]), k=10)
    exact_one_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    exact = exact_top_k(trained, "entities", trained.gather("entities", asked), asked, 10, metric)
    exact_batch_s = time.perf_counter() - t0
    result = {
        "rows": rows,
        "metric": metric,
        "queries": queries,
        "exact_single_query_s": round(exact_one_s, 3),
        "exact_batch_s": round(exact_batch_s, 2),
    }
    for kind in kinds.split(","):
        t0 = time.perf_counter()
        index = trained.ann_index("entities", metric, kind=kind, folder=folder / kind)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        index = trained.ann_index("entities", metric, kind=kind, folder=folder / kind)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for row in asked.tolist():
            trained.neighbors(row, k=10, approximate=index)
        single_s = (time.perf_counter() - t0) / queries
        t0 = time.perf_counter()
        _, found = index.search(trained.gather("entities", asked), 11)
        batch_s = time.perf_counter() - t0
        hits = recall_hits(found, exact, asked)
        result[kind] = {
            "build_s": round(build_s, 1),
            "build_recall_at_10": round(index.recall, 3),
            "load_s": round(load_s, 2),
            "single_query_s": round(single_s, 5),
            "batch_s": round(batch_s, 3),
            "recall_at_10": round(hits / (10 * queries), 3),
            "index_MB": round(index.path.stat().st_size / 1e6),
            "settings": {
                key: index.manifest[key] for key in ("lists", "probes", "links", "ef_search") if key in index.manifest
            },
            "exact_single_vs_single": round(exact_one_s / single_s, 1),
            "exact_batch_vs_batch": round(exact_batch_s / batch_s, 1),
        }
        for effort in [int(e) for e in efforts.split(",") if e and kind != "flat"]:
            tuned = trained.ann_index("entities", metric, kind=kind, folder=folder / kind, effort=effort)
            t0 = time.perf_counter()
            _, found = tuned.search(trained.gather("entities", asked), 11)
            batch_s = time.perf_counter() - t0
            result[kind][f"effort_{effort}"] = {
                "batch_ms_per_query": round(1000 * batch_s / queries, 3),
                "recall_at_10": round(recall_hits(found, exact, asked) / (10 * queries), 3),
            }
    return result


def recall_hits(found, exact, asked) -> int:
    """How many of each query's exact top 10 the index found, the query's own row left out."""
    return sum(
        len(set([i for i in f if i != own][:10]) & set(e))
        for f, e, own in zip(found.tolist(), exact.tolist(), asked.tolist())
    )


def child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-800:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=10_000_000)
    parser.add_argument("--single-entities", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "dsa-bench-results")
    parser.add_argument(
        "--approximate", action="store_true", help="measure faiss indexes at --single-entities rows (only)"
    )
    parser.add_argument("--kinds", default="ivf,hnsw", help="with --approximate: the index types, comma-separated")
    parser.add_argument(
        "--parts", default="export,predict,single", help="which of export, predict, single to measure (comma-separated)"
    )
    parser.add_argument(
        "--efforts",
        default="16,64,256",
        help="with --approximate: search efforts (hnsw efSearch, ivf nprobe) to measure besides the default",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, run, *rest = args.child
        result = {
            "export": lambda: child_export(Path(run), Path(rest[0])),
            "predict": lambda: child_predict(Path(run), int(rest[0])),
            "single": lambda: child_single(Path(run)),
            "ann": lambda: child_ann(Path(run), int(rest[0]), rest[1], Path(rest[2]), rest[3]),
        }[kind]()
        print(json.dumps(result))
        return
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.approximate:
        small = make_run(args.folder, args.single_entities, args.dim)
        with tempfile.TemporaryDirectory(dir=args.folder) as scratch:
            print(
                json.dumps({"ann": child("ann", str(small), str(args.queries), args.kinds, scratch, args.efforts)}),
                flush=True,
            )
        return
    parts = args.parts.split(",")
    big = make_run(args.folder, args.entities, args.dim)
    if "export" in parts:
        with tempfile.TemporaryDirectory(dir=args.folder) as scratch:
            print(json.dumps({"export": child("export", str(big), scratch)}), flush=True)
    if "predict" in parts:
        print(json.dumps({"predict": child("predict", str(big), str(args.queries))}), flush=True)
    if "single" in parts:
        print(
            json.dumps({"single": child("single", str(make_run(args.folder, args.single_entities, args.dim)))}),
            flush=True,
        )


if __name__ == "__main__":
    main()
