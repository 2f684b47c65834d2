"""One training run of PyKEEN's ``pipeline()`` (sLCWA), run by ``scripts/bench_peers.py`` with
the PyKEEN environment's python (``scripts/peers/setup.sh pykeen``); writes a JSON result to
``--out``.

``--setting equal``: the settings the benchmark holds equal across tools (dimension in reals,
batch size, epochs, Adam and its rate, softplus loss, negatives per positive, no entity
constraint). ``--setting equal-nssa``: the same, but
the loss weighted as dsa-train's softplus (``nssa`` with margin 0 and temperature 0: the
positive's term plus the mean of the negatives' terms, where PyKEEN's softplus averages all
terms alike) and no regulariser or entity constraint for DistMult and ComplEx (PyKEEN's
defaults for them). ``--setting default``: ``pipeline(model=...)`` with nothing else set (PyKEEN's
defaults: 5 epochs, dimension 50, Adam, each model's default loss, one negative per positive).
Validation MRR is measured every ``--valid-every`` epochs by a training callback, its time taken
out of the training time. Test metrics: PyKEEN's ``RankBasedEvaluator``, filtered against
train + valid + test, realistic ranks.

``--max-steps`` (the scale runs of ``scripts/bench_peers_scale.py``): that many sLCWA steps of the
equal setting's TransE on ``ids.npz``, evaluating nothing: one epoch over the first
``max_steps x batch_size`` training triples, with every entity of the graph in the model, timed
after the first ``WARM_STEPS`` as PyG's runner times its steps.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pykeen
import torch
from pykeen.evaluation import RankBasedEvaluator
from pykeen.pipeline import pipeline
from pykeen.training.callbacks import TrainingCallback
from pykeen.triples import TriplesFactory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kg_tsv import WARM_STEPS, Clock, add_max_steps_argument, add_run_arguments, read_graph, write_result  # noqa: E402

NAMES = {"transe": "TransE", "distmult": "DistMult", "complex": "ComplEx", "rotate": "RotatE"}
MRR = "both.realistic.inverse_harmonic_mean_rank"


class ValidationTimes(TrainingCallback):
    """Validation MRR every ``every`` epochs, with the training time so far (its own time excluded)."""

    def __init__(self, clock: Clock, valid, filters, every: int, epochs: int) -> None:
        super().__init__()
        self.clock, self.valid, self.filters, self.every, self.epochs = clock, valid, filters, every, epochs
        self.found: list[dict] = []

    def post_epoch(self, epoch: int, epoch_loss: float, **kwargs) -> None:
        if not self.every or epoch % self.every or epoch >= self.epochs:
            return
        seconds = self.clock.train_seconds()
        began = time.perf_counter()
        result = RankBasedEvaluator(filtered=True).evaluate(
            self.model, self.valid, additional_filter_triples=self.filters, batch_size=256, use_tqdm=False
        )
        self.model.train()
        self.found.append({"epoch": epoch, "train_seconds": seconds, "mrr": float(result.get_metric(MRR))})
        self.clock.excluded += time.perf_counter() - began


class WarmClock(TrainingCallback):
    """A clock started after the first ``WARM_STEPS`` batches."""

    def __init__(self) -> None:
        super().__init__()
        self.batches, self.clock = 0, None

    def on_batch(self, epoch: int, batch, batch_loss: float, **kwargs) -> None:
        self.batches += 1
        if self.batches == WARM_STEPS:
            self.clock = Clock()


def scale_run(args) -> int:
    """``--max-steps`` steps of TransE (L2, no entity constraint, softplus, Adam) on ``ids.npz``."""
    from pykeen.models import TransE
    from pykeen.training import SLCWATrainingLoop
    from pykeen.triples import CoreTriplesFactory

    ids = np.load(args.data / "ids.npz")
    train = torch.from_numpy(ids["train"][: args.max_steps * args.batch_size])
    factory = CoreTriplesFactory.create(
        mapped_triples=train, num_entities=int(ids["entities"]), num_relations=int(ids["relations"])
    )
    model = TransE(
        triples_factory=factory,
        embedding_dim=args.dim,
        scoring_fct_norm=2,
        entity_constrainer=None,
        loss="softplus",
        random_seed=args.seed,
    )
    loop = SLCWATrainingLoop(
        model=model,
        triples_factory=factory,
        optimizer=torch.optim.Adam(model.parameters(), lr=args.lr),
        negative_sampler="basic",
        negative_sampler_kwargs={"num_negs_per_pos": args.negatives},
    )
    warm = WarmClock()
    loop.train(triples_factory=factory, num_epochs=1, batch_size=args.batch_size, use_tqdm=False, callbacks=warm)
    steps = -(-factory.num_triples // args.batch_size)
    write_result(
        args.out,
        {
            "tool": "pykeen",
            "version": pykeen.get_version(),
            "train_seconds": warm.clock.train_seconds(),
            "train_triples": factory.num_triples - WARM_STEPS * args.batch_size,
            "steps": steps,
            "settings": {"optimizer": "Adam (dense)", "negatives_per_positive": args.negatives},
        },
    )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=NAMES, required=True)
    p.add_argument("--setting", choices=["equal", "equal-nssa", "default"], required=True)
    add_run_arguments(p)  # --epochs: the equal setting's (the default setting runs PyKEEN's 5)
    p.add_argument("--negatives", type=int, default=64, help="negatives per positive")
    add_max_steps_argument(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    if args.max_steps is not None:
        return scale_run(args)
    entities, relations, splits = read_graph(args.data)
    factories = {
        s: TriplesFactory(torch.tensor(rows, dtype=torch.long), entity_to_id=entities, relation_to_id=relations)
        for s, rows in splits.items()
    }
    equal = args.setting.startswith("equal")
    epochs = args.epochs if equal else 5
    clock = Clock()
    callback = ValidationTimes(
        clock,
        factories["valid"].mapped_triples,
        [factories["train"].mapped_triples, factories["test"].mapped_triples],
        args.valid_every,
        epochs,
    )
    kwargs: dict = {}
    if equal:
        complex_like = args.model in ("complex", "rotate")
        model_kwargs = {"embedding_dim": args.dim // 2 if complex_like else args.dim}
        if args.model == "transe":
            model_kwargs.update(scoring_fct_norm=2, entity_constrainer=None)
        kwargs = dict(
            model_kwargs=model_kwargs,
            loss="softplus",
            optimizer="Adam",
            optimizer_kwargs={"lr": args.lr},
            negative_sampler="basic",
            negative_sampler_kwargs={"num_negs_per_pos": args.negatives},
        )
        if args.setting == "equal-nssa":
            # softplus(-s) + the mean of softplus(s') over the negatives, as dsa-train weighs
            # them (PyKEEN's softplus averages all 65 terms alike), with no regulariser and no
            # entity constraint (DistMult's and ComplEx's defaults have them)
            kwargs.update(loss="nssa", loss_kwargs={"margin": 0.0, "adversarial_temperature": 0.0})
            if args.model in ("distmult", "complex"):
                model_kwargs["regularizer"] = None
            if args.model == "distmult":
                model_kwargs["entity_constrainer"] = None
    result = pipeline(
        training=factories["train"],
        validation=factories["valid"],
        testing=factories["test"],
        model=NAMES[args.model],
        training_loop="sLCWA",
        training_kwargs={
            "num_epochs": epochs,
            "batch_size": args.batch_size if equal else None,
            "callbacks": callback,
            "use_tqdm": False,
        },
        evaluator="rankbased",
        evaluator_kwargs={"filtered": True},
        evaluation_kwargs={"use_tqdm": False},
        random_seed=args.seed,
        device="cpu",
        **kwargs,
    )
    train_seconds = result.train_seconds - callback.clock.excluded
    model = result.model
    valid_final = RankBasedEvaluator(filtered=True).evaluate(
        model,
        factories["valid"].mapped_triples,
        additional_filter_triples=[factories["train"].mapped_triples, factories["test"].mapped_triples],
        batch_size=256,
        use_tqdm=False,
    )
    valid = callback.found + [
        {"epoch": epochs, "train_seconds": train_seconds, "mrr": float(valid_final.get_metric(MRR))}
    ]
    metrics = result.metric_results
    write_result(
        args.out,
        {
            "tool": "pykeen",
            "version": pykeen.get_version(),
            "train_seconds": train_seconds,
            "train_triples": epochs * factories["train"].num_triples,
            "epochs": epochs,
            "valid": valid,
            "test": {
                "mrr": float(metrics.get_metric(MRR)),
                "hits_at_10": float(metrics.get_metric("both.realistic.hits_at_10")),
                "evaluator": "PyKEEN RankBasedEvaluator, filtered, realistic",
            },
            "settings": {
                "model": repr(type(model).__name__),
                "parameters": int(sum(np.prod(p.shape) for p in model.parameters())),
                "loss": type(model.loss).__name__,
                "epochs": epochs,
                "batch_size": args.batch_size if equal else "default (256)",
                **{k: v for k, v in kwargs.items() if k != "model_kwargs"},
                **kwargs.get("model_kwargs", {}),
            },
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
