"""node2vec the way most users run it: PecanPy's walks fed to gensim's skip-gram (Word2Vec).

Runs in its own environment (``scripts/peers/setup.sh pecanpy``: PecanPy pins numpy below 2),
so it imports neither torch nor dsa_train. Reads an undirected edge list (``u<TAB>v`` node ids,
one line per edge), writes the embeddings as a ``.npy`` of ``(nodes, dim)`` float32 rows in
node-id order, and a JSON of its timings:

- ``walk_s``: PecanPy's ``SparseOTF`` preprocessing and walk simulation, numba's compilation
  included (a user pays it on every run);
- ``train_s``: gensim's vocabulary scan and its ``epochs`` of skip-gram;
- ``walks_per_s``, ``pairs_per_s`` (pairs: gensim's trained words x the window it averages).

    python run_pecanpy.py --edges cora.tsv --nodes 2708 --out emb.npy --result r.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--edges", required=True, help="undirected edge list: u<TAB>v per line")
    p.add_argument("--nodes", type=int, required=True, help="node ids are 0 .. nodes - 1")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--walk-nodes", type=int, default=21, help="nodes per walk (dsa-train's walk_length + 1)")
    p.add_argument("--walks-per-node", type=int, default=10)
    p.add_argument("--window", type=int, default=10, help="gensim's window: up to this many nodes on each side")
    p.add_argument("--p", type=float, default=1.0)
    p.add_argument("--q", type=float, default=1.0)
    p.add_argument("--negatives", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the embeddings, a .npy")
    p.add_argument("--result", required=True, help="the timings, a JSON")
    args = p.parse_args()

    from gensim.models import Word2Vec
    from pecanpy import pecanpy

    began = time.perf_counter()
    graph = pecanpy.SparseOTF(p=args.p, q=args.q, workers=args.workers, verbose=False, random_state=args.seed)
    graph.read_edg(args.edges, weighted=False, directed=False)
    walks = graph.simulate_walks(num_walks=args.walks_per_node, walk_length=args.walk_nodes)
    walk_s = time.perf_counter() - began

    began = time.perf_counter()
    model = Word2Vec(
        walks,
        vector_size=args.dim,
        window=args.window,
        min_count=0,
        sg=1,
        hs=0,
        negative=args.negatives,
        workers=args.workers,
        epochs=args.epochs,
        seed=args.seed,
    )
    train_s = time.perf_counter() - began

    rows = np.zeros((args.nodes, args.dim), dtype=np.float32)  # a node no walk reached stays at 0
    for key in model.wv.index_to_key:  # PecanPy's walks name nodes by the edge list's ids, as strings
        rows[int(key)] = model.wv[key]
    np.save(args.out, rows)
    words = sum(len(w) for w in walks)
    with open(args.result, "w") as f:
        json.dump(
            {
                "walk_s": walk_s,
                "train_s": train_s,
                "walks": len(walks),
                "walks_per_s": len(walks) / walk_s,
                # gensim shrinks each window to a uniform 1..window: (window + 1) / 2 a side on average
                "pairs_per_s": args.epochs * words * (args.window + 1) / train_s,
                "nodes_embedded": len(model.wv.index_to_key),
            },
            f,
        )


if __name__ == "__main__":
    main()
