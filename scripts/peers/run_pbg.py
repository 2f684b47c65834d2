"""One training run of PyTorch-BigGraph, run by ``scripts/bench_peers.py`` with the PBG
environment's python (``scripts/peers/setup.sh pbg``); writes a JSON result to ``--out``.

As PBG's ``examples/fb15k.py`` does: ``convert_input_data`` imports the TSV splits (one
partition, dynamic relations), ``train(config)``, then ``do_eval`` of the test split with PBG's
``FilteredRankingEvaluator`` (filtered against train + valid + test; a rank counts the
candidates scoring at least as high as the answer: pessimistic ranks, where ours and PyKEEN's are
realistic). PBG has no validation pass along the way (``eval_fraction`` holds out training
edges), so no time to a validation MRR. Models: TransE = ``translation`` operator with the ``l2``
comparator, DistMult = ``diagonal`` + ``dot``, ComplEx = ``complex_diagonal`` + ``dot``
(``dimension`` reals: half real, half imaginary parts); PBG has no RotatE. PBG learns a second
operator per relation for head queries (dynamic relations), like dsa-train's reciprocal
relations. Its only optimizer is Adagrad (row-wise for entities).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import attr  # noqa: E402
import torch  # noqa: E402
from torchbiggraph.config import parse_config  # noqa: E402
from torchbiggraph.converters.import_from_tsv import convert_input_data  # noqa: E402
from torchbiggraph.eval import do_eval_and_report_stats  # noqa: E402
from torchbiggraph.filtered_eval import FilteredRankingEvaluator  # noqa: E402
from torchbiggraph.train import train  # noqa: E402
from torchbiggraph.util import SubprocessInitializer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kg_tsv import SPLITS, write_result  # noqa: E402

OPERATORS = {"transe": ("translation", "l2"), "distmult": ("diagonal", "dot"), "complex": ("complex_diagonal", "dot")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--model", choices=OPERATORS, required=True)
    p.add_argument("--setting", choices=["equal", "default"], required=True)
    p.add_argument("--epochs", type=int, required=True, help="equal setting (default: the FB15k example's 50)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument(
        "--negatives", type=int, default=32, help="uniform negatives per chunk, shared, scored on both sides"
    )
    p.add_argument("--valid-every", type=int, default=0, help="(unused: PBG does not validate along the way)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    work = args.out.parent / "pbg"
    operator, comparator = OPERATORS[args.model]
    if args.setting == "equal":
        settings = dict(
            dimension=args.dim,
            num_epochs=args.epochs,
            batch_size=args.batch_size,
            num_uniform_negs=args.negatives,
            num_batch_negs=0,
            loss_fn="logistic",
            lr=0.01,
        )
    else:  # examples/configs/fb15k_config.py, with this model's operator and comparator
        settings = dict(dimension=400, num_epochs=50, num_uniform_negs=1000, loss_fn="softmax", lr=0.1)
    config = parse_config(
        dict(
            entity_path=str(work / "entities"),
            edge_paths=[str(work / f"{s}_partitioned") for s in SPLITS],
            checkpoint_path=str(work / "model"),
            entities={"all": {"num_partitions": 1}},
            relations=[{"name": "all_edges", "lhs": "all", "rhs": "all", "operator": operator}],
            dynamic_relations=True,
            global_emb=False,
            comparator=comparator,
            eval_fraction=0,
            workers=args.threads,
            **settings,
        )
    )
    convert_input_data(
        config.entities,
        config.relations,
        config.entity_path,
        config.edge_paths,
        [args.data / f"{s}.txt" for s in SPLITS],
        lhs_col=0,
        rhs_col=2,
        rel_col=1,
        dynamic_relations=True,
    )
    train_triples = sum(1 for line in (args.data / "train.txt").read_text().splitlines() if line.strip())
    subprocess_init = SubprocessInitializer()
    began = time.perf_counter()
    train(attr.evolve(config, edge_paths=[config.edge_paths[0]]), subprocess_init=subprocess_init)
    train_seconds = time.perf_counter() - began
    relations = [attr.evolve(r, all_negs=True) for r in config.relations]
    test_path = config.edge_paths[2]
    eval_config = attr.evolve(config, edge_paths=[test_path], relations=relations, num_uniform_negs=0)
    evaluator = FilteredRankingEvaluator(eval_config, [test_path, config.edge_paths[1], config.edge_paths[0]])
    stats = None
    for edge_path, bucket, found in do_eval_and_report_stats(
        eval_config, evaluator=evaluator, subprocess_init=subprocess_init
    ):
        if edge_path is None and bucket is None:
            stats = found
    metrics = stats.metrics
    write_result(
        args.out,
        {
            "tool": "pbg",
            "version": "1.0.0",
            "train_seconds": train_seconds,
            "train_triples": settings["num_epochs"] * train_triples,
            "epochs": settings["num_epochs"],
            "valid": [],
            "test": {
                "mrr": metrics["mrr"],
                "hits_at_10": metrics["r10"],
                "evaluator": "PBG FilteredRankingEvaluator, filtered, pessimistic ranks",
            },
            "settings": {"operator": operator, "comparator": comparator, "optimizer": "Adagrad", **settings},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
