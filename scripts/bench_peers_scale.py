"""Scale beside the peers: one generated knowledge graph per size, a fixed number of TransE steps
of each tool that can hold it, triples/s and peak memory (issue 47's 10^6- and 10^7-entity rows).

    python scripts/bench_peers_scale.py --entities 1000000,10000000 --json docs/peers/scale.json

The graph: ``--entities`` entities, 2 training triples per entity, 100 relations, heads and
tails drawn with density falling as 1/sqrt(id) (a few entities in many triples, most in few, as
in real graphs), written as TSV (what ``dsa-train run`` imports, its import timed in the wall
time but not in triples/s) and as ``ids.npz`` (what PyG's runner reads). Every tool trains
TransE (L2), dim ``--dim``, batch ``--batch-size``, Adam-family at 0.01, and evaluates nothing:
these rows measure what a step costs and what the process holds, not quality.

Tools: ``ours`` (the table in RAM, DiskSparseAdam's moments on disk), ``ours-disk`` (the table
on disk too: ``model.embedding_storage: disk``), ``pyg`` (its example's dense Adam: the table,
its gradient and two moments in RAM, every row updated each step), ``pyg-sparse``
(``sparse=True`` and ``torch.optim.SparseAdam``: the table and two dense moments), ``pykeen``
(sLCWA with dense Adam, in the environment ``scripts/peers/setup.sh pykeen`` makes; "not
installed" without it). A tool whose
tables would need more than three quarters of the RAM available is not started (starting it
would push this shared machine into swap or the OOM killer); its row says how much it needs.

Negatives: PyG scores one corrupted triple per positive and cannot score more; dsa-train shares
``--negatives`` / 2 entities per step, scored on both sides (default 2, PyG's count plus one);
PyKEEN corrupts ``--negatives`` triples per positive.
Triples/s counts the steps after the first ten (PyG, PyKEEN: ``kg_tsv.WARM_STEPS``) or after
the first logged window (ours: the ``items_per_s`` of its ``train`` records, steps' own seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_peers import run_measured  # noqa: E402

TOOLS = ("ours", "ours-disk", "pyg", "pyg-sparse", "pykeen")
RELATIONS = 100
GiB = 2**30


def write_graph(folder: Path, entities: int, seed: int = 0) -> int:
    """The TSV splits and ``ids.npz`` of the generated graph; returns the training triples."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ids = {}
    for split, count in (("train", 2 * entities), ("valid", 100), ("test", 100)):
        heads = (entities * rng.random(count) ** 2).astype(np.int64)  # density ~ 1/sqrt(id)
        tails = (entities * rng.random(count) ** 2).astype(np.int64)
        relations = rng.integers(0, RELATIONS, count)
        triples = np.stack([heads, relations, tails], axis=1)
        ids[split] = triples
        with open(folder / f"{split}.txt", "w") as f:
            for start in range(0, count, 1_000_000):
                chunk = triples[start : start + 1_000_000]
                f.write("".join(f"e{h}\tr{r}\te{t}\n" for h, r, t in chunk.tolist()))
    # ids as PyG reads them: entities numbered as the TSV names them (every id < entities)
    np.savez(folder / "ids.npz", entities=entities, relations=RELATIONS, **ids)
    return len(ids["train"])


def need_bytes(tool: str, entities: int, dim: int) -> int:
    """RAM the tool's tables need: the entity table, plus what its optimizer keeps beside it."""
    table = entities * dim * 4
    return {"ours": table, "ours-disk": 0, "pyg": 4 * table, "pyg-sparse": 3 * table, "pykeen": 4 * table}[tool]


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def ours_recipe(graph: Path, args, disk: bool) -> str:
    return json.dumps(
        {
            "name": "scale",
            "dataset": {"kind": "tsv", "path": str(graph)},
            "model": {
                "kind": "transe",
                "p_norm": 2,
                "dim": args.dim,
                "init_std": 0.1,
                "dropout": 0,
                "reciprocal": False,
                "embedding_storage": "disk" if disk else "memory",
            },
            "train": {
                "epochs": 1,
                "max_steps": args.steps,
                "batch_size": args.batch_size,
                "negatives": max(1, args.negatives // 2),
                "batch_negatives": False,
                "loss": "softplus",
                "log_every": 10,
                "checkpoint_every": 10**9,
            },
            "optimizer": {"kind": "dsa", "lr": 0.01},
            "eval": {"every_epochs": 0, "final_splits": []},
        }
    )


def run_tool(tool: str, graph: Path, entities: int, args) -> dict:
    row = {"entities": entities, "tool": tool}
    python = args.peers_home / "pykeen" / "bin" / "python" if tool == "pykeen" else Path(sys.executable)
    if not python.exists():
        return {**row, "status": "not installed"}
    need = need_bytes(tool, entities, args.dim)
    free = available_bytes()
    if need > 0.75 * free:  # the rest for torch, the ids, the page cache and this machine's other work
        return {
            **row,
            "status": f"not started: its tables need {need / GiB:.1f} GiB of RAM, {free / GiB:.1f} GiB available",
        }
    with tempfile.TemporaryDirectory(prefix=f"scale-{tool}-", dir=args.work) as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        if tool.startswith("ours"):
            recipe = tmp / "scale.yaml"
            recipe.write_text(ours_recipe(graph, args, disk=tool == "ours-disk"))
            argv = [sys.executable, "-m", "dsa_train", "run", str(recipe), "-o", str(tmp / "run")]
            env["DSA_DATA_ROOT"] = str(tmp / "data")  # the import's own folder, removed with tmp
        else:
            runner = "run_pykeen.py" if tool == "pykeen" else "run_pyg.py"
            argv = [str(python), str(ROOT / "scripts" / "peers" / runner), "--data", str(graph)]
            argv += ["--model", "transe", "--setting", "equal", "--epochs", "1", "--dim", str(args.dim)]
            argv += ["--batch-size", str(args.batch_size), "--threads", str(args.threads)]
            argv += ["--max-steps", str(args.steps), "--out", str(tmp / "result.json")]
            if tool == "pyg-sparse":
                argv.append("--sparse")
            if tool == "pykeen":
                argv += ["--negatives", str(args.negatives)]
        measured = run_measured(argv, env, tmp, args.timeout)
        row["command"] = " ".join(argv).replace(str(tmp), "$TMP").replace(str(graph), "$GRAPH")
        if measured["rc"] != 0:
            return {**row, "status": f"failed (exit {measured['rc']})", "tail": measured["tail"], **measured}
        if tool.startswith("ours"):
            triples, seconds = ours_window_pace(tmp / "run", args.batch_size)
        else:
            result = json.loads((tmp / "result.json").read_text())
            triples, seconds = result["train_triples"], result["train_seconds"]
    return {
        **row,
        "status": "ok",
        "triples_per_s": triples / seconds,
        "peak_rss_anon_mib": measured["peak_rss_anon_mib"],
        "wall_s": measured["wall_s"],
        "needs_ram_gib": need / GiB,
    }


def ours_window_pace(run: Path, batch_size: int) -> tuple[float, float]:
    """Triples and their steps' own seconds over the ``train`` records after the first."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r["kind"] == "train"]
    triples = seconds = 0.0
    for before, record in zip(train, train[1:]):
        items = (record["step"] - before["step"]) * batch_size
        triples += items
        seconds += items / record["items_per_s"]
    return triples, seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entities", default="1000000,10000000", help="graph sizes, comma-separated")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"of {', '.join(TOOLS)}")
    p.add_argument("--steps", type=int, default=300, help="training steps of each tool")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--negatives", type=int, default=2, help="negative scores per positive (PyG: always 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--work", type=Path, default=None, help="where the graphs and runs go (default: a temp folder)")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument(
        "--peers-home",
        type=Path,
        default=Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "dsa-train-peers")),
        help="where scripts/peers/setup.sh put the peers' environments",
    )
    args = p.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    unknown = set(tools) - set(TOOLS)
    if unknown:
        p.error(f"unknown tools {sorted(unknown)}; choose from {', '.join(TOOLS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="scale-graphs-", dir=args.work) as graphs:
        for entities in (int(e) for e in args.entities.split(",")):
            started = time.perf_counter()
            graph = Path(graphs) / f"kg-{entities}"
            triples = write_graph(graph, entities)
            print(
                f"graph of {entities:,} entities, {triples:,} training triples: {time.perf_counter() - started:.0f} s"
            )
            for tool in tools:
                row = run_tool(tool, graph, entities, args)
                rows.append(row)
                shown = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if k != "tail"}
                print(json.dumps(shown), flush=True)
            for name in ("train.txt", "valid.txt", "test.txt", "ids.npz"):
                (graph / name).unlink()
    print()
    print("| entities | tool | triples/s | peak RssAnon MiB | wall s | status |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['triples_per_s']:,.0f}" if "triples_per_s" in r else ""
        peak = f"{r['peak_rss_anon_mib']:,.0f}" if "peak_rss_anon_mib" in r else ""
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else ""
        print(f"| {r['entities']:,} | {r['tool']} | {rate} | {peak} | {wall} | {r['status']} |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows},
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
