"""PyKEEN's filtered ranking of fixed embeddings: a fixture our evaluation is checked against.

Run with a PyKEEN environment's python (``scripts/peers/setup.sh pykeen``), not ours:

    ~/.cache/dsa-train-peers/pykeen/bin/python scripts/peers/make_eval_fixture.py \
        -o tests/fixtures/pykeen_eval.json

It draws a small random graph (seeded: 60 entities, 8 relations, distinct triples split into
train, valid and test) and, per case, entity and relation vectors laid out as dsa-train lays out
its rows (TransE and DistMult: ``dim`` reals; ComplEx and RotatE entities: ``[real parts | imaginary
parts]``, ``dim / 2`` complex coordinates; RotatE relations: ``dim / 2`` phases). Some entity rows are copies of others, and one case has integer
vectors, so that many scores tie exactly. It loads the vectors into PyKEEN's own model, checks
that PyKEEN's ``score_hrt`` equals the formula dsa-train scores with (so both evaluate the same
function), and writes PyKEEN's ``RankBasedEvaluator`` metrics: filtered against train + valid +
test, head and tail queries, realistic ranks (mean of optimistic and pessimistic).
``tests/test_peer_evaluation.py`` ranks the same vectors with dsa-train's evaluation and compares.

``--export DIR --data DIR`` instead evaluates vectors that ``dsa-train export`` wrote (a run
trained with ``model.reciprocal=false`` and, for TransE, ``model.normalize_entities=false``),
on the graph in ``--data`` (train.txt, valid.txt, test.txt) and prints PyKEEN's metrics as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pykeen
import torch
from pykeen.evaluation import RankBasedEvaluator
from pykeen.models import ComplEx, DistMult, RotatE, TransE
from pykeen.triples import CoreTriplesFactory

NUM_ENTITIES, NUM_RELATIONS = 60, 8
SPLITS = {"train": 300, "valid": 50, "test": 60}
DUPLICATES = {59: 58, 57: 56, 55: 54, 53: 3, 52: 10}  # entity row -> the row it copies
CASES = [  # name, kind, options, dim (reals), integer vectors
    ("transe-l1", "transe", {"p_norm": 1}, 8, False),
    ("transe-l2", "transe", {"p_norm": 2}, 8, False),
    ("distmult", "distmult", {}, 8, False),
    ("distmult-integers", "distmult", {}, 4, True),
    ("complex", "complex", {}, 8, False),
    ("rotate", "rotate", {}, 8, False),
]
METRICS = {  # ours -> PyKEEN's realistic-rank metric
    "mr": "arithmetic_mean_rank",
    "mrr": "inverse_harmonic_mean_rank",
    "hits_at_1": "hits_at_1",
    "hits_at_3": "hits_at_3",
    "hits_at_10": "hits_at_10",
}


def random_graph(rng: np.random.Generator) -> dict[str, np.ndarray]:
    total = sum(SPLITS.values())
    seen: set[tuple[int, int, int]] = set()
    triples = []
    while len(triples) < total:
        h, r, t = int(rng.integers(NUM_ENTITIES)), int(rng.integers(NUM_RELATIONS)), int(rng.integers(NUM_ENTITIES))
        if h != t and (h, r, t) not in seen:
            seen.add((h, r, t))
            triples.append((h, r, t))
    triples = np.array(triples, dtype=np.int64)
    out, start = {}, 0
    for split, count in SPLITS.items():
        out[split] = triples[start : start + count]
        start += count
    return out


def draw_vectors(rng, kind: str, dim: int, integers: bool) -> tuple[np.ndarray, np.ndarray]:
    def draw(shape):
        return rng.integers(-1, 2, shape) if integers else rng.normal(size=shape)

    entities = draw((NUM_ENTITIES, dim)).astype(np.float32)
    for row, source in DUPLICATES.items():
        entities[row] = entities[source]
    if kind == "rotate":  # phases, one per complex coordinate
        relations = rng.uniform(0, 2 * np.pi, (NUM_RELATIONS, dim // 2)).astype(np.float32)
    else:
        relations = draw((NUM_RELATIONS, dim)).astype(np.float32)
    return entities, relations


def our_score(kind: str, options: dict, e: np.ndarray, r: np.ndarray, h, rel, t) -> np.ndarray:
    """dsa-train's score of triples (h, rel, t), in float64, from the formulas in
    dsa_train/models/scoring/*.py (reciprocal=False: one relation row for both sides)."""
    e, r = e.astype(np.float64), r.astype(np.float64)
    if kind == "transe":
        return -np.linalg.norm(e[h] + r[rel] - e[t], ord=options["p_norm"], axis=-1)
    if kind == "distmult":
        return (e[h] * r[rel] * e[t]).sum(-1)
    if kind == "complex":
        half = e.shape[1] // 2
        c = lambda x: x[..., :half] + 1j * x[..., half:]  # noqa: E731  [re | im] -> complex
        return np.real((c(e[h]) * c(r[rel]) * np.conj(c(e[t]))).sum(-1))
    if kind == "rotate":
        half = e.shape[1] // 2
        c = lambda x: x[..., :half] + 1j * x[..., half:]  # noqa: E731
        return -np.sqrt((np.abs(c(e[h]) * np.exp(1j * r[rel]) - c(e[t])) ** 2).sum(-1))  # ours adds gamma
    raise ValueError(kind)


def pykeen_model(kind: str, options: dict, dim: int, factory: CoreTriplesFactory, e: np.ndarray, r: np.ndarray):
    """PyKEEN's model of ``kind`` holding vectors ``e`` and ``r`` (dsa-train's layout)."""
    if kind == "transe":
        # scoring_fct_norm: the p of -||h + r - t||_p, set explicitly; no constrainer, so the
        # vectors are scored as they are (PyKEEN's default normalises entities after each step).
        model = TransE(
            triples_factory=factory,
            embedding_dim=dim,
            scoring_fct_norm=options["p_norm"],
            entity_constrainer=None,
            random_seed=0,
        )
        tables = (e, r)
    elif kind == "distmult":
        model = DistMult(triples_factory=factory, embedding_dim=dim, random_seed=0)
        tables = (e, r)
    elif kind in ("complex", "rotate"):
        # PyKEEN stores a complex row as interleaved (re, im) pairs of reals; ours is [re | im].
        half = dim // 2
        interleave = lambda x: np.stack([x[:, :half], x[:, half:]], -1).reshape(len(x), dim)  # noqa: E731
        if kind == "complex":
            model = ComplEx(triples_factory=factory, embedding_dim=half, random_seed=0)
            tables = (interleave(e), interleave(r))
        else:  # ours stores phases; PyKEEN's relations are unit complex numbers
            model = RotatE(triples_factory=factory, embedding_dim=half, random_seed=0)
            unit = np.concatenate([np.cos(r), np.sin(r)], 1)
            tables = (interleave(e), interleave(unit))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for representation, table in zip((model.entity_representations[0], model.relation_representations[0]), tables):
            weight = representation._embeddings.weight
            if tuple(weight.shape) != table.shape:
                raise SystemExit(f"{kind}: PyKEEN's table is {tuple(weight.shape)}, ours {table.shape}")
            weight.copy_(torch.as_tensor(table, dtype=weight.dtype))
    model.eval()
    return model


def check_scores(model, kind, options, e, r, triples: np.ndarray) -> float:
    """The largest difference between PyKEEN's score_hrt and our formula on ``triples``."""
    with torch.no_grad():
        theirs = model.score_hrt(torch.as_tensor(triples)).squeeze(-1).double().numpy()
    ours = our_score(kind, options, e, r, triples[:, 0], triples[:, 1], triples[:, 2])
    gap = float(np.abs(theirs - ours).max())
    if gap > 1e-4 * max(1.0, float(np.abs(ours).max())):
        raise SystemExit(f"{kind}: PyKEEN's score_hrt differs from dsa-train's formula by {gap}")
    return gap


def pykeen_metrics(model, test: np.ndarray, filters: list[np.ndarray]) -> dict[str, dict[str, float]]:
    evaluator = RankBasedEvaluator(filtered=True)
    result = evaluator.evaluate(
        model,
        mapped_triples=torch.as_tensor(test),
        additional_filter_triples=[torch.as_tensor(f) for f in filters],
        batch_size=64,
        use_tqdm=False,
    )
    return {
        side: {ours: float(result.get_metric(f"{side}.realistic.{theirs}")) for ours, theirs in METRICS.items()}
        for side in ("tail", "head", "both")
    }


def make_fixture(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    graph = random_graph(rng)
    factory = CoreTriplesFactory.create(
        mapped_triples=torch.as_tensor(graph["train"]), num_entities=NUM_ENTITIES, num_relations=NUM_RELATIONS
    )
    everything = np.concatenate(list(graph.values()))
    cases = []
    for name, kind, options, dim, integers in CASES:
        e, r = draw_vectors(rng, kind, dim, integers)
        model = pykeen_model(kind, options, dim, factory, e, r)
        gap = check_scores(model, kind, options, e, r, everything)
        metrics = pykeen_metrics(model, graph["test"], [graph["train"], graph["valid"]])
        print(f"{name}: score gap {gap:.2e}, both MRR {metrics['both']['mrr']:.4f}", file=sys.stderr)
        cases.append(
            {
                "name": name,
                "kind": kind,
                "options": options,
                "dim": dim,
                "entities": e.tolist(),
                "relations": r.tolist(),
                "pykeen": metrics,
                "max_score_gap": gap,
            }
        )
    return {
        "about": "PyKEEN RankBasedEvaluator, filtered (train+valid+test), realistic ranks; "
        "made by scripts/peers/make_eval_fixture.py",
        "pykeen_version": pykeen.get_version(),
        "torch_version": torch.__version__,
        "seed": seed,
        "num_entities": NUM_ENTITIES,
        "num_relations": NUM_RELATIONS,
        "duplicate_rows": {str(k): v for k, v in DUPLICATES.items()},
        "splits": {split: rows.tolist() for split, rows in graph.items()},
        "cases": cases,
    }


def read_split(folder: Path, split: str, entities: dict[str, int], relations: dict[str, int]) -> np.ndarray:
    rows = []
    for line in (folder / f"{split}.txt").read_text().splitlines():
        if line.strip():
            h, r, t = line.split("\t")
            rows.append((entities[h], relations[r], entities[t]))
    return np.array(rows, dtype=np.int64)


def names(path: Path) -> dict[str, int]:
    """``TABLE.names.tsv`` (id<TAB>name, maybe under a header) as name -> row."""
    out = {}
    for line in path.read_text().splitlines():
        row, _, name = line.partition("\t")
        if row.isdigit():
            out[name] = int(row)
    return out


def evaluate_export(export: Path, data: Path) -> dict:
    info = json.loads((export / "export.json").read_text())
    model_cfg = info["settings"]  # the recipe's model section
    kind = info["model"]
    if model_cfg.get("reciprocal", True):
        raise SystemExit(
            "the run has reciprocal relations (head queries use inverse rows): train it with model.reciprocal=false"
        )
    if model_cfg.get("normalize_entities"):
        raise SystemExit(
            "the run normalises entities in its scores but exports raw rows: train it with normalize_entities=false"
        )
    e = np.load(export / "entities.npy").astype(np.float32)
    r = np.load(export / "relations.npy").astype(np.float32)
    entities, relations = names(export / "entities.names.tsv"), names(export / "relations.names.tsv")
    graph = {split: read_split(data, split, entities, relations) for split in ("train", "valid", "test")}
    factory = CoreTriplesFactory.create(
        mapped_triples=torch.as_tensor(graph["train"]), num_entities=len(e), num_relations=len(r)
    )
    options = {"p_norm": model_cfg.get("p_norm", 2)} if kind == "transe" else {}
    model = pykeen_model(kind, options, e.shape[1], factory, e, r)
    gap = check_scores(model, kind, options, e, r, graph["test"])
    metrics = pykeen_metrics(model, graph["test"], [graph["train"], graph["valid"]])
    return {"kind": kind, "pykeen_version": pykeen.get_version(), "max_score_gap": gap, "pykeen": metrics}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, help="where to write the fixture (JSON)")
    parser.add_argument("--seed", type=int, default=47)
    parser.add_argument("--export", type=Path, help="a folder `dsa-train export` wrote: evaluate it instead")
    parser.add_argument("--data", type=Path, help="with --export: the graph's folder (train.txt, valid.txt, test.txt)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.export:
        if not args.data:
            parser.error("--export needs --data")
        print(json.dumps(evaluate_export(args.export, args.data), indent=2))
        return 0
    if not args.output:
        parser.error("give -o/--output (or --export)")
    fixture = make_fixture(args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(fixture) + "\n")
    print(f"wrote {args.output} ({len(fixture['cases'])} cases, PyKEEN {fixture['pykeen_version']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
