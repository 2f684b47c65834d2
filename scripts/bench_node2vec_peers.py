"""dsa-train's node2vec beside PecanPy + gensim, the pipeline most node2vec users run.

On the graph of a node2vec recipe (Cora by default), with the same walks where the tools allow
it (walks of ``walk_length`` steps, ``walks_per_node`` from every node, p, q, dimension, one
negative), each tool trains in its own process with the same thread count, and both tools'
embeddings are probed by the same classifier (dsa-train's logistic-regression probe on the
recipe's split, :func:`dsa_train.train.node2vec.evaluate_node_embeddings`). Per run:

- wall seconds: the process from start to exit (imports, graph loading, numba's compilation,
  evaluation included);
- training seconds: dsa-train's epochs (walks are drawn inside its steps); PecanPy's walks
  and gensim's skip-gram, apart;
- peak RssAnon: the process and its children, polled every 20 ms;
- probe accuracy on the valid and test nodes.

What cannot be made equal: gensim pairs each node with a window drawn uniformly from 1 to
``--window`` nodes on each side of it (about ``window + 1`` pairs a node); dsa-train, as PyG's
Node2Vec, pairs the first node of each ``context_size``-node window with the other nodes in it
(about ``(walk_length - context_size + 2) * (context_size - 1) / (walk_length + 1)`` pairs a
node, 5.1 at the recipe's 20 and 10). gensim trains by SGD with a decaying rate, one pair at a
time; dsa-train by Adam on batches.

    DSA_DATA_ROOT=/path/to/datasets python scripts/bench_node2vec_peers.py --repeats 2

The peer is looked for in ``--peers-home`` (``scripts/peers/setup.sh pecanpy`` makes it); when
it is not installed its rows say so. Prints a markdown table; ``--json`` writes every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_peers import run_measured  # noqa: E402

from dsa_train.data import load_graph  # noqa: E402
from dsa_train.recipe import Recipe, load_recipe  # noqa: E402
from dsa_train.results import open_run  # noqa: E402
from dsa_train.train.node2vec import evaluate_node_embeddings  # noqa: E402

TOOLS = ("ours", "pecanpy")
SPLITS = ("valid", "test")


def recipe_path(name: str) -> Path:
    path = Path(name)
    return path if path.suffix in (".yaml", ".yml") else ROOT / "recipes" / f"{name}.yaml"


def write_edges(recipe: Recipe, path: Path) -> int:
    """The recipe's training graph as an undirected edge list (each edge once); its node count."""
    graph = load_graph(recipe.dataset)
    degree = graph.rowptr[1:] - graph.rowptr[:-1]
    source = torch.repeat_interleave(torch.arange(graph.num_nodes), degree.long())
    col = graph.col.long()
    keep = source < col
    np.savetxt(path, torch.stack([source[keep], col[keep]], 1).numpy(), fmt="%d", delimiter="\t")
    return graph.num_nodes


def probe(recipe: Recipe, embeddings: torch.Tensor) -> dict[str, float]:
    """Probe accuracy on the valid and test nodes (a split without nodes is left out)."""
    graph = load_graph(recipe.dataset)
    found = {split: evaluate_node_embeddings(graph, embeddings, split, recipe).get("probe") for split in SPLITS}
    return {split: metrics["accuracy"] for split, metrics in found.items() if metrics}


def run_ours(args, tmp: Path, env: dict, seed: int) -> dict:
    run = tmp / "run"
    argv = [sys.executable, "-m", "dsa_train", "run", str(recipe_path(args.recipe)), "-o", str(run)]
    argv += [a for s in [*args.overrides, f"train.seed={seed}"] for a in ("--set", s)]
    measured = run_measured(argv, env, tmp, args.timeout)
    if measured["rc"] != 0:
        return {**measured, "status": "failed"}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_s = sum(r["seconds"] for r in records if r["kind"] == "epoch")
    return {**measured, "train_s": train_s, "embeddings": open_run(run).weights("nodes").clone()}


def run_pecanpy(args, tmp: Path, env: dict, recipe: Recipe, seed: int) -> dict:
    python = args.peers_home / "pecanpy" / "bin" / "python"
    if not python.exists():
        return {"status": "not installed"}
    c = recipe.model.node2vec
    nodes = write_edges(recipe, tmp / "edges.tsv")
    argv = [str(python), str(ROOT / "scripts" / "peers" / "run_pecanpy.py"), "--edges", str(tmp / "edges.tsv")]
    argv += ["--nodes", str(nodes), "--dim", str(recipe.model.dim), "--walk-nodes", str(c.walk_length + 1)]
    argv += ["--walks-per-node", str(c.walks_per_node), "--window", str(args.window), "--p", str(c.p)]
    argv += ["--q", str(c.q), "--negatives", str(c.negatives), "--epochs", str(args.gensim_epochs)]
    argv += ["--workers", str(args.threads), "--seed", str(seed)]
    argv += ["--out", str(tmp / "emb.npy"), "--result", str(tmp / "result.json")]
    measured = run_measured(argv, env, tmp, args.timeout)
    if measured["rc"] != 0:
        return {**measured, "status": "failed"}
    result = json.loads((tmp / "result.json").read_text())
    return {**measured, **result, "embeddings": torch.from_numpy(np.load(tmp / "emb.npy"))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="cora-node2vec", help="a node2vec recipe file or a shipped recipe's name")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="recipe override, key=value (repeatable): our runs train with it, and the peer reads the graph, "
        "walks and dimension from the recipe with it",
    )
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS for ours, gensim's and PecanPy's workers")
    p.add_argument("--window", type=int, default=10, help="gensim's window (up to this many nodes a side)")
    p.add_argument("--gensim-epochs", type=int, default=1)
    p.add_argument("--peers-home", type=Path, default=Path.home() / ".cache" / "dsa-train-peers")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", type=Path, help="write every run's figures here")
    args = p.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        p.error(f"unknown tools {unknown}: known are {', '.join(TOOLS)}")
    recipe = load_recipe(recipe_path(args.recipe), args.overrides)
    if recipe.model.kind != "node2vec":
        p.error(f"--recipe {args.recipe} trains {recipe.model.kind!r}, not node2vec")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    runs = []
    for repeat in range(args.repeats):
        for tool in tools[repeat % len(tools) :] + tools[: repeat % len(tools)]:  # rotate who goes first
            with tempfile.TemporaryDirectory(prefix=f"n2v-{tool}-") as tmp:
                seed = recipe.train.seed + repeat  # each repeat its own walks, the same for both tools' count
                if tool == "ours":
                    row = run_ours(args, Path(tmp), env, seed)
                else:
                    row = run_pecanpy(args, Path(tmp), env, recipe, seed)
            if "embeddings" in row:
                row.update(probe(recipe, row.pop("embeddings")), status="ok")
            row.update(tool=tool, repeat=repeat)
            if row.get("status") == "ok":
                row.pop("tail", None)
            runs.append(row)
            print(json.dumps(row), file=sys.stderr)
    print(f"\n{recipe.name}, {args.threads} threads, {args.repeats} repeats (medians; accuracy's min-max):\n")
    print("| tool | wall s | training s | walks s | peak RssAnon MiB | valid accuracy | test accuracy |")
    print("|---|---|---|---|---|---|---|")
    for tool in tools:
        ok = [r for r in runs if r["tool"] == tool and r.get("status") == "ok"]
        if not ok:
            status = next((r.get("status") for r in runs if r["tool"] == tool), "not run")
            print(f"| {tool} | {status} | | | | | |")
            continue
        med = {key: statistics.median(r[key] for r in ok) for key in ok[0] if isinstance(ok[0][key], float)}
        walks = f"{med['walk_s']:.1f}" if tool == "pecanpy" else "(in training)"
        accuracy = [
            f"{med[s]:.3f} ({min(r[s] for r in ok):.3f}-{max(r[s] for r in ok):.3f})" if s in med else "no nodes"
            for s in SPLITS
        ]
        print(
            f"| {tool} | {med['wall_s']:.1f} | {med['train_s']:.1f} | {walks} | {med['peak_rss_anon_mib']:,.0f} | "
            f"{accuracy[0]} | {accuracy[1]} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"recipe": recipe.name, "threads": args.threads, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
