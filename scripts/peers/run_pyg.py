"""One training run of PyG's ``torch_geometric.nn.kge`` models, as in PyG's
``examples/kge_fb15k_237.py`` (``model.loader`` + a torch optimizer, ``model.loss``: one random
corrupted triple per positive, each model's own loss). Run by ``scripts/bench_peers.py`` with the
project's python (PyG is one of its dependencies); writes a JSON result to ``--out``.

``--max-steps`` (the scale runs of ``scripts/bench_peers_scale.py``) trains that many steps of the
equal setting and evaluates nothing; ``--sparse`` builds the tables with ``sparse=True`` and
trains them with ``torch.optim.SparseAdam`` instead of the example's dense Adam.

Test metrics: PyG's own ``model.test`` (raw: not filtered) and, so that the figures compare with
the other tools', dsa-train's filtered realistic ranking of the same model's scores
(``tests/test_peer_evaluation.py`` checks that ranking against PyKEEN's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch_geometric
from torch_geometric.nn import kge

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kg_tsv import WARM_STEPS, Clock, add_max_steps_argument, add_run_arguments, read_graph, write_result  # noqa: E402

#: graphs larger than this skip PyG's own raw ``model.test``: it scores one test triple per
#: forward pass (WN18RR's 3,134 took 7 of a run's 8 minutes here); the filtered figures are ours
OWN_TEST_ENTITIES = 10_000
MODELS = {"transe": kge.TransE, "distmult": kge.DistMult, "complex": kge.ComplEx, "rotate": kge.RotatE}
# examples/kge_fb15k_237.py: hidden_channels 50, batch 1,000, these optimizers (RotatE is not in
# the example's stored version: Adam at 0.001).
EXAMPLE_OPTIMIZERS = {
    "transe": (torch.optim.Adam, {"lr": 0.01}),
    "distmult": (torch.optim.Adam, {"lr": 0.0001, "weight_decay": 1e-6}),
    "complex": (torch.optim.Adagrad, {"lr": 0.001, "weight_decay": 1e-6}),
    "rotate": (torch.optim.Adam, {"lr": 0.001}),
}


def query_vectors(model, anchor: torch.Tensor, relation: torch.Tensor, side: str):
    """PyG's score of every candidate as one matrix operation against the entity table: a query
    per (anchor, relation) and the table it meets, and whether the score is a product (``dot``)
    or minus a distance (``-dist``, plus a constant). Derived from each model's ``forward`` and
    checked against it by :func:`check_against_forward`."""
    import torch.nn.functional as F

    name = type(model).__name__
    if name == "TransE":  # -|| n(h) + r - n(t) ||: tail side n(h) + r against n(t); head side n(t) - r against n(h)
        p = model.p_norm
        a, r = F.normalize(model.node_emb(anchor), p=p, dim=-1), model.rel_emb(relation)
        table = F.normalize(model.node_emb.weight, p=p, dim=-1)
        return (a + r if side == "tail" else a - r), table, "dist", p, 0.0
    if name == "DistMult":  # (h * r) . t, symmetric in h and t
        return model.node_emb(anchor) * model.rel_emb(relation), model.node_emb.weight, "dot", None, 0.0
    a_re, a_im = model.node_emb(anchor), model.node_emb_im(anchor)
    table = torch.cat([model.node_emb.weight, model.node_emb_im.weight], dim=1)
    if name == "ComplEx":  # Re(<h, r, conj(t)>)
        r_re, r_im = model.rel_emb(relation), model.rel_emb_im(relation)
        if side == "tail":
            q = torch.cat([a_re * r_re - a_im * r_im, a_im * r_re + a_re * r_im], dim=1)
        else:
            q = torch.cat([r_re * a_re + r_im * a_im, r_re * a_im - r_im * a_re], dim=1)
        return q, table, "dot", None, 0.0
    if name == "RotatE":  # margin - || h o r - t ||, |r| = 1: head side || h - t o conj(r) ||
        theta = model.rel_emb(relation)
        r_re, r_im = torch.cos(theta), torch.sin(theta)
        if side == "tail":
            q = torch.cat([r_re * a_re - r_im * a_im, r_re * a_im + r_im * a_re], dim=1)
        else:
            q = torch.cat([a_re * r_re + a_im * r_im, a_im * r_re - a_re * r_im], dim=1)
        return q, table, "dist", 2.0, float(model.margin)
    raise SystemExit(f"no matrix scoring for {name}")


def matrix_scores(model, anchor, relation, candidates, side):
    q, table, kind, p, offset = query_vectors(model, anchor, relation, side)
    rows = table[candidates]
    if kind == "dot":
        return q @ rows.T
    return offset - torch.cdist(q, rows, p=p, compute_mode="donot_use_mm_for_euclid_dist")


def check_against_forward(model, triples: torch.Tensor, num_entities: int) -> float:
    """The largest gap between :func:`matrix_scores` and PyG's own ``forward`` on 64 queries
    of ``triples`` against 64 random candidates, both sides; raises if above 1e-4 of the scores'
    scale (a derivation that is wrong, not rounding)."""
    g = torch.Generator().manual_seed(0)
    queries = triples[torch.randperm(len(triples), generator=g)[:64]]
    candidates = torch.randint(num_entities, (64,), generator=g)
    worst = 0.0
    for side in ("tail", "head"):
        anchor = queries[:, 0] if side == "tail" else queries[:, 2]
        got = matrix_scores(model, anchor, queries[:, 1], candidates, side)
        a, r, c = anchor[:, None].expand_as(got), queries[:, 1][:, None].expand_as(got), candidates[None].expand_as(got)
        h, t = (a, c) if side == "tail" else (c, a)
        want = model(h.reshape(-1), r.reshape(-1), t.reshape(-1)).view_as(got)
        gap = float((got - want).abs().max())
        if gap > 1e-4 * max(1.0, float(want.abs().max())):
            raise SystemExit(f"matrix scores of {type(model).__name__} ({side}) differ from its forward by {gap}")
        worst = max(worst, gap)
    return worst


def filtered_metrics(
    model, test: torch.Tensor, everything: torch.Tensor, num_entities: int, num_relations: int
) -> dict:
    """dsa-train's filtered realistic ranking of PyG's scores, every candidate scored at once by
    :func:`matrix_scores` (checked against the model's ``forward`` first)."""
    from dsa_train.eval import TripleIndex
    from dsa_train.eval.ranking import evaluate_link_prediction

    check_against_forward(model, test, num_entities)

    def score_fn(anchor, relation, candidates, side, out=None):  # writes no buffer: a new matrix each batch
        return matrix_scores(model, anchor, relation, candidates, side)

    index = TripleIndex.from_triples(everything, num_entities, num_relations)
    metrics = evaluate_link_prediction(score_fn, test, index, num_entities=num_entities, batch_size=256)
    return {side: m.as_dict() for side, m in metrics.items()}


def scale_run(args) -> int:
    """``--max-steps`` steps of the equal setting on ``ids.npz`` (written beside the TSV files
    by ``bench_peers_scale.py``: reading tens of millions of TSV lines as Python tuples would
    measure the reader, not PyG); the seconds of the steps after the first ``WARM_STEPS``."""
    import numpy as np

    ids = np.load(args.data / "ids.npz")
    n, r, train = int(ids["entities"]), int(ids["relations"]), torch.from_numpy(ids["train"])
    hidden = args.dim // 2 if args.model in ("complex", "rotate") else args.dim
    extra = {"p_norm": 2.0} if args.model == "transe" else {}
    model = MODELS[args.model](n, r, hidden, sparse=args.sparse, **extra)
    kind = torch.optim.SparseAdam if args.sparse else torch.optim.Adam
    optimizer = kind(model.parameters(), lr=args.lr)
    loader = model.loader(
        head_index=train[:, 0], rel_type=train[:, 1], tail_index=train[:, 2], batch_size=args.batch_size, shuffle=True
    )
    steps, warm = 0, None
    while steps < args.max_steps:
        for h, rel, t in loader:
            optimizer.zero_grad()
            model.loss(h, rel, t).backward()
            optimizer.step()
            steps += 1
            if steps == WARM_STEPS:
                warm = Clock()
            if steps == args.max_steps:
                break
    seconds = warm.train_seconds()
    write_result(
        args.out,
        {
            "tool": "pyg",
            "version": torch_geometric.__version__,
            "train_seconds": seconds,
            "train_triples": (steps - WARM_STEPS) * args.batch_size,
            "steps": steps,
            "settings": {"optimizer": kind.__name__, "sparse": args.sparse, "negatives_per_positive": 1},
        },
    )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--setting", choices=["equal", "default"], required=True)
    add_run_arguments(p)
    add_max_steps_argument(p)
    p.add_argument("--sparse", action="store_true", help="sparse tables and torch.optim.SparseAdam")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.max_steps is not None:
        return scale_run(args)
    entities, relations, splits = read_graph(args.data)
    tensors = {s: torch.tensor(rows, dtype=torch.long) for s, rows in splits.items()}
    train = tensors["train"]
    n, r = len(entities), len(relations)
    if args.setting == "equal":
        hidden = args.dim // 2 if args.model in ("complex", "rotate") else args.dim
        extra = {"p_norm": 2.0} if args.model == "transe" else {}
        model = MODELS[args.model](n, r, hidden, **extra)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        batch_size = args.batch_size
    else:
        model = MODELS[args.model](n, r, 50)
        kind, options = EXAMPLE_OPTIMIZERS[args.model]
        optimizer = kind(model.parameters(), **options)
        batch_size = 1000
    loader = model.loader(
        head_index=train[:, 0], rel_type=train[:, 1], tail_index=train[:, 2], batch_size=batch_size, shuffle=True
    )
    everything = torch.cat([tensors[s] for s in ("train", "valid", "test")])
    clock, valid = Clock(), []
    for epoch in range(1, args.epochs + 1):
        model.train()
        for h, rel, t in loader:
            optimizer.zero_grad()
            loss = model.loss(h, rel, t)
            loss.backward()
            optimizer.step()
        if args.valid_every and epoch % args.valid_every == 0 and epoch < args.epochs:
            seconds = clock.train_seconds()
            model.eval()
            with torch.no_grad():
                both = filtered_metrics(model, tensors["valid"], everything, n, r)["both"]
            valid.append({"epoch": epoch, "train_seconds": seconds, "mrr": both["mrr"]})
            clock.excluded += clock.train_seconds() - seconds
    train_seconds = clock.train_seconds()
    model.eval()
    with torch.no_grad():
        valid.append(
            {
                "epoch": args.epochs,
                "train_seconds": train_seconds,
                "mrr": filtered_metrics(model, tensors["valid"], everything, n, r)["both"]["mrr"],
            }
        )
        test = filtered_metrics(model, tensors["test"], everything, n, r)
        own_test = {"evaluator": "PyG model.test (raw, not filtered)"}
        if n <= OWN_TEST_ENTITIES:
            raw_mr, raw_mrr, raw_hits = model.test(
                tensors["test"][:, 0], tensors["test"][:, 1], tensors["test"][:, 2], batch_size=20000, k=10, log=False
            )
            own_test.update(mrr=raw_mrr, hits_at_10=raw_hits, mr=raw_mr)
        else:
            own_test["skipped"] = f"{n:,} entities: model.test ranks one test triple per forward pass"
    write_result(
        args.out,
        {
            "tool": "pyg",
            "version": torch_geometric.__version__,
            "train_seconds": train_seconds,
            "train_triples": args.epochs * len(train),
            "epochs": args.epochs,
            "valid": valid,
            "test": {
                "mrr": test["both"]["mrr"],
                "hits_at_10": test["both"]["hits_at_10"],
                "evaluator": "dsa-train filtered realistic, on PyG's scores",
            },
            "own_test": own_test,
            "settings": {
                "hidden_channels": model.hidden_channels,
                "batch_size": batch_size,
                "optimizer": repr(optimizer).split("(")[0],
                "lr": optimizer.param_groups[0]["lr"],
                "negatives_per_positive": 1,
                "loss": "PyG's own",
            },
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
