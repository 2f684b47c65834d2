"""dsa-train beside its peers (PyKEEN, PyG's kge models, PyTorch-BigGraph) on UMLS, Nations, FB15k-237 and WN18RR.

Each cell (graph x model x setting x tool) is one training run in its own process, with the same
thread count (``OMP_NUM_THREADS`` and ``torch.set_num_threads``) and the same OpenMP wait policy
for every tool. Within a (graph, model, setting) the tools run one after the other, in an order
that rotates with each repeat, so a busy spell on a shared machine falls on all of them. Per run:

- training triples/s: epochs x training triples / training seconds (each tool's own training
  loop timed by itself, validation passes taken out);
- peak RssAnon: the run's process and its children, ``/proc/<pid>/status`` polled every 20 ms;
- wall seconds: the process from start to exit (imports, data loading, evaluation included);
- training seconds until validation MRR first reached ``--target-mrr`` (filtered, realistic),
  where the tool validates along the way (every ``--valid-every`` epochs);
- filtered test MRR and Hits@10 (realistic ranks) by each tool's own evaluator; PyG's
  ``model.test`` does not filter, so its figures are dsa-train's ranking of PyG's scores (its
  own raw figures are in the JSON).

Settings ``equal``: dimension ``--dim`` in reals (ComplEx and RotatE: dim / 2 complex
coordinates), batch ``--batch-size``, ``--epochs``, Adam at 0.01, softplus loss, no dropout, no
entity normalisation, no reciprocal relations, 64 negative scores per positive (see
docs/peers.md for what each tool can and cannot match). ``default``: each tool's own
recommendation (dsa-train's shipped recipe as it is; PyKEEN's ``pipeline()`` defaults; PyG's
``examples/kge_fb15k_237.py`` settings for ``--default-epochs``; PBG's ``examples/fb15k.py``
config with its TransE/DistMult/ComplEx operators).

    python scripts/bench_peers.py --graphs nations --models distmult --tools ours,pyg --epochs 5

Peers are looked for in ``--peers-home`` (``scripts/peers/setup.sh`` makes them); a tool that is
not installed is reported as ``not installed`` in its cell. Prints a markdown table; ``--json``
writes every run's figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsa_train.memory import rss_anon_bytes  # noqa: E402

PEERS = ROOT / "scripts" / "peers"
#: each graph's folder of train.txt, valid.txt and test.txt under --data-root (FB15k-237's and
#: WN18RR's as PyG downloads them)
GRAPH_FOLDERS = {"umls": "umls", "nations": "nations", "fb15k237": "FB15k-237/raw", "wn18rr": "WN18RR/raw"}
GRAPHS = tuple(GRAPH_FOLDERS)
MODELS = ("transe", "distmult", "complex", "rotate")
TOOLS = ("ours", "pykeen", "pyg", "pbg", "libkge")
SETTINGS = ("equal", "default", "equal-nssa")
NOT_INSTALLED = "not installed"


def peer_python(tool: str, peers_home: Path) -> Path | None:
    """The python that runs ``tool``, or None when it is not installed."""
    if tool in ("ours", "pyg"):
        if tool == "pyg" and importlib.util.find_spec("torch_geometric") is None:
            return None
        return Path(sys.executable)
    python = peers_home / tool / "bin" / "python"
    return python if python.exists() else None


def command(tool: str, python: Path, graph: str, model: str, setting: str, args, out: Path) -> list[str] | str:
    """The command line of one run, or why there is none."""
    data = str(args.data_root / GRAPH_FOLDERS[graph])
    epochs = args.default_epochs if (tool, setting) == ("pyg", "default") else args.epochs
    common = ["--data", data, "--model", model, "--setting", setting, "--epochs", str(epochs)]
    common += ["--valid-every", str(args.valid_every), "--threads", str(args.threads), "--out", str(out)]
    if tool == "ours":
        return [str(python), "-m", "dsa_train", "run", *ours_recipe(graph, model, setting, args)]
    if setting == "equal-nssa" and tool != "pykeen":
        return "the equal-nssa setting changes PyKEEN's loss only"
    if tool == "pykeen":
        return [
            str(python),
            str(PEERS / "run_pykeen.py"),
            *common,
            "--dim",
            str(args.dim),
            "--batch-size",
            str(args.batch_size),
            "--negatives",
            str(args.negatives),
        ]
    if tool == "pyg":
        return [
            str(python),
            str(PEERS / "run_pyg.py"),
            *common,
            "--dim",
            str(args.dim),
            "--batch-size",
            str(args.batch_size),
        ]
    if tool == "pbg":
        if model == "rotate":
            return "no RotatE operator in PBG"
        return [
            str(python),
            str(PEERS / "run_pbg.py"),
            *common,
            "--dim",
            str(args.dim),
            "--batch-size",
            str(args.batch_size),
            "--negatives",
            str(max(1, args.negatives // 2)),  # per chunk, scored on both sides
        ]
    return f"no runner for {tool}"


def ours_recipe(graph: str, model: str, setting: str, args) -> list[str]:
    """``dsa-train run`` arguments: the shipped recipe (the UMLS one where the graph has none of
    its own, and for the equal setting on a graph whose shipped recipe reads it through PyG)
    reading the graph's folder under ``--data-root`` (``dataset.path``, which a recipe's
    ``dataset.fetch`` yields to: the same files every tool reads), plus the equal setting's
    overrides."""
    shipped = ROOT / "recipes" / f"{graph}-{model}.yaml"
    through_pyg = graph in ("fb15k237", "wn18rr")
    if shipped.exists() and not (through_pyg and setting.startswith("equal")):
        recipe = shipped
    else:
        recipe = ROOT / "recipes" / f"umls-{model}.yaml"
    folder = (args.data_root / GRAPH_FOLDERS[graph]).resolve()
    # PyG's class reads <data root>/FB15k-237/raw/ itself ($DSA_DATA_ROOT is --data-root)
    sets = [] if recipe == shipped and through_pyg else [f"dataset.path={folder}"]
    if setting.startswith("equal"):
        sets += [
            f"model.dim={args.dim}",
            "model.dropout=0",
            "model.reciprocal=false",
            "model.normalize_entities=false",
            f"train.epochs={args.epochs}",
            f"train.batch_size={args.batch_size}",
            f"train.negatives={max(1, args.negatives // 2)}",  # shared by a step's head and tail queries: 2 x 32 scores
            "train.batch_negatives=false",
            "train.loss=softplus",
            "optimizer.lr=0.01",
            f"eval.every_epochs={args.valid_every}",
        ]
        if model == "transe":
            sets.append("model.p_norm=2")  # as every peer's TransE here (umls-transe ships L1)
    out = [str(recipe)]
    for s in sets:
        out += ["--set", s]
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def run_measured(argv: list[str], env: dict, cwd: Path, timeout: float) -> dict:
    """Run ``argv``; its wall time, exit status, output tail and peak RssAnon (with children)."""
    began = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    stop = threading.Event()

    def poll():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, sum(rss_anon_bytes(p) for p in descendants(proc.pid)))
            stop.wait(0.02)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        output += f"\n(killed after {timeout:.0f} s)"
    stop.set()
    watcher.join()
    return {
        "rc": proc.returncode,
        "wall_s": time.perf_counter() - began,
        "peak_rss_anon_mib": peak / 2**20,
        "tail": output[-2000:],
    }


def ours_result(cwd: Path, train_triples: int) -> dict:
    """Figures of the run ``dsa-train run`` left under ``cwd/runs``, from its metrics.jsonl
    (``train_triples``: the training split's size; metrics.jsonl rounds each epoch's seconds)."""
    (run,) = sorted((cwd / "runs").iterdir())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    seconds_by_epoch, total = {}, 0.0
    for r in epochs:
        total += r["seconds"]
        seconds_by_epoch[r["epoch"]] = total
    valid = [
        {"epoch": r["epoch"], "train_seconds": seconds_by_epoch.get(r["epoch"], total), "mrr": r["both"]["mrr"]}
        for r in records
        if r["kind"] == "eval" and r.get("split") == "valid"
    ]
    tests = [r for r in records if r["kind"] == "eval" and r.get("split") == "test"]
    both = tests[-1]["both"]
    from dsa_train import __version__

    return {
        "tool": "ours",
        "version": __version__,
        "train_seconds": total,
        "train_triples": len(epochs) * train_triples,
        "epochs": len(epochs),
        "valid": valid,
        "test": {"mrr": both["mrr"], "hits_at_10": both["hits_at_10"], "evaluator": "dsa-train filtered realistic"},
        "run": str(run.name),
    }


def run_cell(tool: str, graph: str, model: str, setting: str, repeat: int, args) -> dict:
    cell = {"graph": graph, "model": model, "setting": setting, "tool": tool, "repeat": repeat}
    python = peer_python(tool, args.peers_home)
    if python is None:
        return {**cell, "status": NOT_INSTALLED}
    with tempfile.TemporaryDirectory(prefix=f"bench-peers-{tool}-") as tmp:
        tmp = Path(tmp)
        out = tmp / "result.json"
        argv = command(tool, python, graph, model, setting, args, out)
        if isinstance(argv, str):
            return {**cell, "status": f"n/a: {argv}"}
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads),
            "MKL_NUM_THREADS": str(args.threads),
            "DSA_DATA_ROOT": str(args.data_root),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        if args.omp_wait_policy:
            env["OMP_WAIT_POLICY"] = args.omp_wait_policy
        measured = run_measured(argv, env, tmp, args.timeout)
        cell["command"] = " ".join(argv).replace(str(tmp), "$TMP")
        if measured["rc"] != 0:
            return {**cell, "status": f"failed (exit {measured['rc']})", "tail": measured["tail"]}
        if tool == "ours":
            lines = (args.data_root / GRAPH_FOLDERS[graph] / "train.txt").read_text().splitlines()
            result = ours_result(tmp, sum(1 for line in lines if line.strip()))
        else:
            result = json.loads(out.read_text())
    reached = [v["train_seconds"] for v in result["valid"] if v["mrr"] >= args.target_mrr]
    return {
        **cell,
        "status": "ok",
        "triples_per_s": result["train_triples"] / result["train_seconds"],
        "peak_rss_anon_mib": measured["peak_rss_anon_mib"],
        "wall_s": measured["wall_s"],
        "train_s": result["train_seconds"],
        "train_s_to_target": (min(reached) if reached else None) if result["valid"] else "n/a",
        "test_mrr": result["test"]["mrr"],
        "test_hits_at_10": result["test"]["hits_at_10"],
        "result": result,
    }


def median(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def table(cells: list[dict], target: float) -> str:
    """One markdown row per (graph, model, setting, tool): medians over repeats."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["graph"], c["model"], c["setting"], c["tool"]), []).append(c)
    rows = []
    fastest: dict[tuple, float] = {}
    summary = {}
    for key, runs in groups.items():
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            summary[key] = {"status": runs[0]["status"]}
            continue
        s = {
            f: median([r[f] for r in ok])
            for f in ("triples_per_s", "peak_rss_anon_mib", "wall_s", "test_mrr", "test_hits_at_10")
        }
        to_target = [r["train_s_to_target"] for r in ok]
        s["to_target"] = "n/a" if all(t == "n/a" for t in to_target) else median(to_target)
        s["runs"] = len(ok)
        summary[key] = s
        fastest[key[:3]] = max(fastest.get(key[:3], 0.0), s["triples_per_s"])
    head = (
        f"| graph | model | setting | tool | triples/s | x fastest | peak RssAnon MiB | wall s | train s to valid MRR {target} "
        "| test MRR | Hits@10 |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for key, s in summary.items():
        if "status" in s:
            rows.append(f"| {' | '.join(key)} | {s['status']} | | | | | | |")
            continue
        if s["to_target"] == "n/a":
            to_target = "n/a"
        elif s["to_target"] is None:
            to_target = "not reached"
        else:
            to_target = f"{s['to_target']:.1f}"
        rows.append(
            f"| {' | '.join(key)} | {s['triples_per_s']:,.0f} | {s['triples_per_s'] / fastest[key[:3]]:.2f} "
            f"| {s['peak_rss_anon_mib']:,.0f} | {s['wall_s']:.1f} | {to_target} | {s['test_mrr']:.4f} | {s['test_hits_at_10']:.4f} |"
        )
    return "\n".join([head, *rows])


def names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    chosen = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(known)})")
    return chosen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", default="umls,nations", help=f"of {', '.join(GRAPHS)}, each read from --data-root")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tools", default="ours,pykeen,pyg,pbg")
    p.add_argument("--settings", default="equal,default", help=f"of {', '.join(SETTINGS)}")
    p.add_argument("--epochs", type=int, default=20, help="equal setting (and PyG's default row): epochs of every tool")
    p.add_argument(
        "--default-epochs",
        type=int,
        default=100,
        help="PyG's default row (its example's settings run 500 epochs; 100 is what dsa-train's recipes run)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--dim", type=int, default=128, help="real coordinates per entity")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument(
        "--negatives",
        type=int,
        default=64,
        help="negative scores per positive triple (PyG always scores 1; dsa-train and PBG share half as many per step, scored on both sides)",
    )
    p.add_argument("--valid-every", type=int, default=5)
    p.add_argument("--target-mrr", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of every tool's process (dsa-train sets PASSIVE itself; '' leaves each tool's default)",
    )
    p.add_argument("--data-root", type=Path, default=Path(os.environ.get("DSA_DATA_ROOT", "/work/shared/datasets")))
    p.add_argument(
        "--peers-home",
        type=Path,
        default=Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "dsa-train-peers")),
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    p.add_argument(
        "--render", type=Path, nargs="+", help="print the tables of these --json files (one per graph), run nothing"
    )
    args = p.parse_args(argv)
    if args.render:
        cells = [c for path in args.render for c in json.loads(path.read_text())["cells"]]
        for graph in dict.fromkeys(c["graph"] for c in cells):
            print(f"{graph}:\n\n{table([c for c in cells if c['graph'] == graph], args.target_mrr)}\n")
        return 0
    graphs, models = names(args.graphs, GRAPHS, "graphs"), names(args.models, MODELS, "models")
    tools, settings = names(args.tools, TOOLS, "tools"), names(args.settings, SETTINGS, "settings")
    cells = []
    began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for repeat in range(args.repeats):
        for graph in graphs:
            for model in models:
                for setting in settings:
                    shift = repeat % len(tools)
                    for tool in tools[shift:] + tools[:shift]:
                        cell = run_cell(tool, graph, model, setting, repeat, args)
                        cells.append(cell)
                        shown = (
                            f"{cell.get('triples_per_s', 0):,.0f} triples/s"
                            if cell["status"] == "ok"
                            else cell["status"]
                        )
                        print(f"{graph} {model} {setting} {tool} #{repeat}: {shown}", file=sys.stderr, flush=True)
                        if cell["status"].startswith("failed"):
                            print(cell["tail"], file=sys.stderr)
    print(table(cells, args.target_mrr))
    if args.json:
        regime = {
            "started": began,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        args.json.write_text(json.dumps({"regime": regime, "cells": cells}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
