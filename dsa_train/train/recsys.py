"""Click prediction (a recommender's ranking stage) as a training task: impressions in, AUC
and log loss out.

A batch is ``batch_size`` training impressions of a click log (:class:`~dsa_train.data.ClickLog`);
their categorical values are hashed into the feature table's rows
(:func:`~dsa_train.models.recsys.table_rows`) and the DLRM's click logits scored with the
logistic loss. The table is the only sparse parameter (DiskSparseAdam, or SparseAdam); the
MLPs are dense (torch's Adam at ``optimizer.dense_lr``). Evaluation scores every impression
of a split (a seeded sample of ``eval.max_queries`` during training): AUC, log loss,
normalised entropy, and on generated data the AUC of the true click probabilities.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import progress
from ..data import ClickLog, load_click_log
from ..data.clicks import ClickBatch
from ..data.order import Shuffle
from ..errors import ConfigError
from ..eval.clicks import click_metrics
from ..models.recsys import DLRM, table_rows
from ..recipe import Recipe
from .sizes import FLOAT_BYTES, Working, check_sizes, keys_of
from .tables import TableSite, disk_table
from .task import Task

EVAL_CHUNK = 1 << 14  # impressions scored at once in an evaluation


def recsys_working(recipe: Recipe, log: ClickLog, ids_per_sample: float) -> list[Working]:
    """What a step holds at once (see :meth:`RecsysTask.loss`): per impression its ids (int64
    values, features, rows, positions: 5 copies), each id's gathered row and its gradient,
    the pooled rows, the Gram matrix of the ``F + 1`` vectors and the MLP activations (each
    with its gradient), from the recipe's sizes and the split's mean ids per impression;
    an evaluation chunk the same without gradients."""
    c, dim, f = recipe.model.recsys, recipe.model.dim, log.num_features
    widest = max(
        [dim, log.num_dense, *c.bottom, *c.top, dim * (f + 1) if c.interaction == "cat" else dim + (f + 1) * f // 2]
    )
    per_sample = ids_per_sample * (5 * 8 + 2 * FLOAT_BYTES * dim) + FLOAT_BYTES * (
        2 * (f + 1) * dim + (f + 1) ** 2 + 4 * widest
    )
    b = recipe.train.batch_size
    keys = f"{keys_of(train__batch_size=b, model__dim=dim)}, model.recsys.top={c.top}, model.recsys.bottom={c.bottom}"
    return [
        Working(
            f"one training step ({b:,} impressions, {ids_per_sample:.1f} ids each)",
            int(2 * b * per_sample),
            keys,
            "lower train.batch_size or model.dim",
        ),
        Working(
            f"one evaluation chunk ({EVAL_CHUNK:,} impressions)",
            int(EVAL_CHUNK * per_sample),
            keys_of(model__dim=dim),
            "lower model.dim",
        ),
    ]


class RecsysTask(Task):
    unit = "samples"

    def __init__(self, recipe: Recipe, device: torch.device, tables: TableSite | None = None) -> None:
        self.recipe, self.device = recipe, device
        self.config = c = recipe.model.recsys
        self.log: ClickLog = load_click_log(recipe.dataset)
        self.description = str(self.log)
        if self.log.weighted and c.mode == "mean":
            raise ConfigError(
                [
                    "model.recsys.mode: 'mean' cannot take the click log's per-id weights (torch pools weights by sum only); use 'sum'"
                ]
            )
        f = self.log.num_features
        self.num_rows = c.rows if c.tables == "shared" else f * c.rows
        train = self.log.samples["train"]
        ids_per_sample = (int(self.log.dataset.array("train_bags")[-1]) / train) if train else float(f)
        dense_widths = [self.log.num_dense, *c.bottom, recipe.model.dim] if self.log.num_dense else []
        vectors = f + 1
        top_in = (
            recipe.model.dim + vectors * (vectors - 1) // 2 if c.interaction == "dot" else recipe.model.dim * vectors
        )
        top_widths = [top_in, *c.top, 1]
        weights = sum((a + 1) * b for widths in (dense_widths, top_widths) for a, b in zip(widths[:-1], widths[1:]))
        check_sizes(
            recipe,
            device,
            tables,
            table="features",
            rows=self.num_rows,
            other=4 * weights * FLOAT_BYTES,
            other_keys=f"model.recsys.top={c.top}",
            other_what="the MLPs (weights, gradients and Adam's moments)",
            working=recsys_working(recipe, self.log, max(ids_per_sample, 1.0)),
        )
        table = disk_table(recipe, tables, "features", self.num_rows, std=recipe.model.init_std, bag_mode=c.mode)
        self.model = DLRM(
            self.num_rows,
            recipe.model.dim,
            features=f,
            dense=self.log.num_dense,
            bottom=c.bottom,
            top=c.top,
            interaction=c.interaction,
            mode=c.mode,
            init_std=recipe.model.init_std,
            table=table,
        ).to(device)
        # the last two batches prefetch() gathered: the loop announces the batch after next's
        # step before it runs this one, so the one a step needs is the older of the two
        self._gathered: list[tuple[Tensor, ClickBatch]] = []

    def rows(self, values: Tensor, feature: Tensor) -> Tensor:
        c = self.config
        return table_rows(values, feature, features=self.log.num_features, rows=c.rows, shared=c.tables == "shared")

    def prefetch(self, picked: Tensor) -> None:
        batch = self.log.batch("train", picked)
        self.model.table.prefetch(self.rows(batch.ids, batch.feature))
        self._gathered = [*self._gathered[-1:], (picked, batch)]

    def sparse_parameters(self) -> list[tuple[str, Tensor]]:
        return [("table.weight", self.model.table.weight)]

    def dense_parameters(self) -> list[Tensor]:
        return [p for name, p in self.model.named_parameters() if not name.startswith("table.")]

    def epoch_items(self) -> int:
        return self.log.samples["train"]

    def logits(self, split: str, picked: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """The model's click logits of the impressions ``picked`` of a split, their labels and
        (generated data) their true logits."""
        gathered = [b for p, b in self._gathered if split == "train" and torch.equal(p, picked)]
        batch = gathered[0] if gathered else self.log.batch(split, picked)
        d = self.device
        weights = batch.weights.to(d) if batch.weights is not None else None
        rows = self.rows(batch.ids, batch.feature)
        return self.model(batch.dense.to(d), rows, batch.offsets, weights), batch.labels.to(d), batch.logits

    def loss(self, picked: Tensor) -> Tensor:
        logits, labels, _ = self.logits("train", picked)
        return DLRM.loss(logits, labels)

    @torch.no_grad()
    def evaluate(self, split: str, *, final: bool) -> dict[str, dict]:
        """AUC and log loss of a split; during training at most ``eval.max_queries`` impressions."""
        n = self.log.samples[split]
        limit = None if final else self.recipe.eval.max_queries
        picked = (
            Shuffle(n, self.recipe.train.seed).slice(0, limit) if limit is not None and n > limit else torch.arange(n)
        )
        if not len(picked):
            return {}
        progress.current().eval_start(split, len(picked))
        parts, labels, true = [], [], []
        for start in range(0, len(picked), EVAL_CHUNK):
            logits, y, t = self.logits(split, picked[start : start + EVAL_CHUNK])
            parts.append(logits.float().cpu())
            labels.append(y.cpu())
            true.append(t)
            progress.current().eval_advance(len(y))
        truth = torch.cat(true) if true[0] is not None else None
        return {"clicks": click_metrics(torch.cat(parts), torch.cat(labels), truth)}

    def headline(self, metrics: dict[str, dict]) -> str:
        m = metrics.get("clicks")
        if not m:
            return "no impressions"
        best = f" (best possible {m['best_auc']:.4f})" if "best_auc" in m else ""
        return (
            f"AUC {m['auc']:.4f}{best}, log loss {m['log_loss']:.4f}, normalized entropy {m['normalized_entropy']:.4f}"
        )
