"""Training a knowledge-graph embedding model: a recipe in, a run folder out.

Read it top to bottom: :meth:`KGETraining.setup` loads the data, builds the model and the
optimizer (or restores them from the newest checkpoint), :meth:`KGETraining.train` runs the
epochs, :meth:`KGETraining.step` is one optimizer step, :meth:`KGETraining.evaluate` ranks a
split, :meth:`KGETraining.save_checkpoint` commits a checkpoint, :meth:`KGETraining.close`
releases everything.

Determinism: the data order of epoch ``e`` comes from a generator seeded with ``(seed, e)``,
and each step reseeds torch from ``(seed, step)`` before drawing its negatives and dropout
masks. A resumed run therefore replays exactly what an uninterrupted one does, without
storing any random state.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Protocol

import torch

from ..data import KnowledgeGraph, load_knowledge_graph
from ..errors import DsaError
from ..eval import RankingMetrics, TripleIndex, evaluate_link_prediction
from ..memory import peak_rss_bytes, rss_anon_bytes
from ..models import KGEModel, build_kge_model
from ..models.losses import ranking_loss
from ..recipe import Recipe
from .checkpoint import find_checkpoint, load_model_state, save_checkpoint
from .optimizers import build_optimizer, close_optimizer, load_optimizer_state, restore_state_dir
from .run_folder import MetricsLog, RunFolder, complete_checkpoints

MiB = 1 << 20


class Reporter(Protocol):
    """What the training loop tells its caller (the CLI draws progress bars from it)."""

    def note(self, text: str) -> None: ...
    def epoch_start(self, epoch: int, epochs: int, steps: int, done: int) -> None: ...
    def step_done(self, steps: int, loss: float, triples_per_s: float) -> None: ...
    def epoch_done(self, record: dict) -> None: ...
    def eval_start(self, split: str, queries: int) -> None: ...
    def eval_advance(self, queries: int) -> None: ...
    def eval_done(self, split: str, metrics: dict[str, RankingMetrics]) -> None: ...


class SilentReporter:
    def note(self, text: str) -> None:
        pass

    def epoch_start(self, epoch: int, epochs: int, steps: int, done: int) -> None:
        pass

    def step_done(self, steps: int, loss: float, triples_per_s: float) -> None:
        pass

    def epoch_done(self, record: dict) -> None:
        pass

    def eval_start(self, split: str, queries: int) -> None:
        pass

    def eval_advance(self, queries: int) -> None:
        pass

    def eval_done(self, split: str, metrics: dict[str, RankingMetrics]) -> None:
        pass


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise DsaError(
            "device 'cuda' was asked for, but torch sees no CUDA device",
            hint="use --device cpu (or auto), or install a CUDA build of torch",
        )
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (1 << 62)


class KGETraining:
    def __init__(self, recipe: Recipe, run: RunFolder, *, reporter: Reporter | None = None) -> None:
        self.recipe = recipe
        self.run = run
        self.reporter = reporter or SilentReporter()
        self.device = resolve_device(recipe.train.device)
        self.step_count = 0  # optimizer steps done
        self.epoch = 0  # epochs fully done
        self.batch = 0  # batches done in the current epoch
        self.window = [0.0, 0]  # loss sum and steps since the last train log record
        self.epoch_loss = [0.0, 0]  # loss sum and steps of the current epoch
        self.optimizer_ram = 0  # largest RssAnon growth across one optimizer step

    # -- setup ----------------------------------------------------------------------------
    def setup(self, *, resume: bool) -> None:
        recipe = self.recipe
        self.kg: KnowledgeGraph = load_knowledge_graph(recipe.dataset)
        self.reporter.note(str(self.kg))
        torch.manual_seed(recipe.train.seed)
        self.model: KGEModel = build_kge_model(recipe.model, self.kg.num_entities, self.kg.num_relations).to(self.device)
        state_dir = self.run.state_dir(recipe)
        checkpoint = None
        if resume and complete_checkpoints(self.run.checkpoints):
            checkpoint, trainer, damaged = find_checkpoint(self.run.checkpoints)
            for warning in damaged:
                self.reporter.note(f"warning: {warning}")
            load_model_state(checkpoint, self.model)
            restore_state_dir(checkpoint, state_dir)
            self.step_count, self.epoch, self.batch = trainer["step"], trainer["epoch"], trainer["batch"]
            self.window, self.epoch_loss = trainer["window"], trainer["epoch_loss"]
            self.optimizer_ram = trainer["optimizer_ram"]
            skipped = trainer["skipped_steps"]
            MetricsLog.truncate(self.run.metrics_path, trainer["metrics_records"])
            self.reporter.note(f"resuming from {checkpoint} (step {self.step_count}, epoch {self.epoch + 1})")
        elif resume:
            restore_state_dir(None, state_dir)
            MetricsLog.truncate(self.run.metrics_path, 0)
            self.reporter.note(f"{self.run.path} has no checkpoint yet: starting it from the beginning")
        if not resume and state_dir.exists() and any(state_dir.iterdir()):
            raise DsaError(
                f"optimizer state directory '{state_dir}' already holds state",
                hint="pass --resume to continue that run, or point optimizer.state_dir elsewhere",
            )
        self.optimizer = build_optimizer(recipe.optimizer, self.model, state_dir)
        if checkpoint is not None:
            load_optimizer_state(self.optimizer, checkpoint)
            if hasattr(self.optimizer, "skipped_steps"):
                self.optimizer.skipped_steps = skipped
        self.metrics = MetricsLog(self.run.metrics_path)
        self.index: TripleIndex | None = None

    # -- training -------------------------------------------------------------------------
    def train(self) -> dict:
        cfg = self.recipe.train
        train = self.kg.train
        steps_per_epoch = math.ceil(len(train) / cfg.batch_size)
        started = time.perf_counter()
        while self.epoch < cfg.epochs and not self._step_limit_reached():
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(step_seed(cfg.seed, -1 - self.epoch)))
            self.reporter.epoch_start(self.epoch + 1, cfg.epochs, steps_per_epoch, self.batch)
            epoch_started, epoch_triples = time.perf_counter(), 0
            while self.batch < steps_per_epoch and not self._step_limit_reached():
                triples = train[order[self.batch * cfg.batch_size : (self.batch + 1) * cfg.batch_size]]
                step_started = time.perf_counter()
                loss = self.step(triples.to(self.device))
                self.batch += 1
                epoch_triples += len(triples)
                rate = len(triples) / max(time.perf_counter() - step_started, 1e-9)
                self._account(loss)
                self.reporter.step_done(1, loss, rate)
                if cfg.checkpoint_every and self.step_count % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
            if self.batch < steps_per_epoch:  # stopped by max_steps inside the epoch
                break
            seconds = time.perf_counter() - epoch_started
            record = {
                "kind": "epoch",
                "epoch": self.epoch + 1,
                "step": self.step_count,
                "loss": self.epoch_loss[0] / max(self.epoch_loss[1], 1),
                "seconds": round(seconds, 3),
                "triples_per_s": round(epoch_triples / max(seconds, 1e-9), 1),
            }
            self.metrics.log(record)
            self.reporter.epoch_done(record)
            self.epoch, self.batch, self.epoch_loss = self.epoch + 1, 0, [0.0, 0]
            every = self.recipe.eval.every_epochs
            if every and self.epoch % every == 0 and self.epoch < cfg.epochs:
                self.evaluate(self.recipe.eval.split, final=False)
        last = complete_checkpoints(self.run.checkpoints)
        if not last or int(last[-1].name) != self.step_count:
            self.save_checkpoint()
        self.final_metrics = final = {split: self.evaluate(split, final=True) for split in self.recipe.eval.final_splits}
        summary = {
            "kind": "summary",
            "step": self.step_count,
            "epochs": self.epoch,
            "seconds": round(time.perf_counter() - started, 1),
            "peak_rss_mib": round(peak_rss_bytes() / MiB, 1),
            "optimizer_ram_mib": round(self.optimizer_ram / MiB, 1),
            "optimizer_state_on_disk_mib": round(self._state_bytes_on_disk() / MiB, 1),
            "skipped_steps": getattr(self.optimizer, "skipped_steps", 0),
            "final": {split: {side: m.as_dict() for side, m in metrics.items()} for split, metrics in final.items()},
        }
        self.metrics.log(summary)
        return summary

    def _step_limit_reached(self) -> bool:
        limit = self.recipe.train.max_steps
        return limit is not None and self.step_count >= limit

    def step(self, triples: torch.Tensor) -> float:
        """One optimizer step on a batch of positive triples; returns its loss."""
        cfg, model = self.recipe.train, self.model
        torch.manual_seed(step_seed(cfg.seed, self.step_count))
        model.train()
        heads, relations, tails = triples[:, 0], triples[:, 1], triples[:, 2]
        negatives = torch.randint(0, self.kg.num_entities, (cfg.negatives,), device=self.device)
        # Every triple asks its tail query (h, r, ?) and its head query (?, r, t).
        anchors, answers = torch.cat([heads, tails]), torch.cat([tails, heads])
        relations = torch.cat([relations, relations])
        n = len(triples)
        embedded = model.embed(torch.cat([anchors, answers, negatives]))
        anchor_emb, answer_emb, negative_emb = embedded[: 2 * n], embedded[2 * n : 4 * n], embedded[4 * n :]
        if cfg.batch_negatives:  # the other queries' answers: negatives drawn by popularity
            negatives, negative_emb = torch.cat([answers, negatives]), torch.cat([answer_emb, negative_emb])
        positive, negative = [], []
        for side, rows in (("tail", slice(0, n)), ("head", slice(n, 2 * n))):
            positive.append(model.score_answers(anchor_emb[rows], relations[rows], answer_emb[rows], side))
            negative.append(model.score_candidates(anchor_emb[rows], relations[rows], negative_emb, side))
        masked = answers[:, None] == negatives[None, :]  # a negative that is the query's own answer
        loss = ranking_loss(cfg.loss, torch.cat(positive), torch.cat(negative), masked, margin=cfg.margin)
        if cfg.regularization:  # N3 (Lacroix et al., 2018) on the step's embeddings
            rel_rows = torch.cat([model.relation_for(relations[:n], "tail")[0], model.relation_for(relations[n:], "head")[0]])
            used = (anchor_emb, answer_emb, model.rel_emb(rel_rows))
            loss = loss + cfg.regularization * sum(e.abs().pow(3).sum() for e in used) / (2 * n)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        before = rss_anon_bytes()
        self.optimizer.step()
        self.optimizer_ram = max(self.optimizer_ram, rss_anon_bytes() - before)
        self.step_count += 1
        return loss.item()

    def _account(self, loss: float) -> None:
        self.window[0] += loss
        self.window[1] += 1
        self.epoch_loss[0] += loss
        self.epoch_loss[1] += 1
        if self.step_count % self.recipe.train.log_every == 0:
            self.metrics.log({"kind": "train", "step": self.step_count, "epoch": self.epoch + 1, "loss": self.window[0] / self.window[1]})
            self.window = [0.0, 0]

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self, split: str, *, final: bool) -> dict[str, RankingMetrics]:
        """Rank a split; during training (``final=False``) at most ``eval.max_queries`` triples."""
        if self.index is None:
            self.index = known_triples(self.kg)
        started = time.perf_counter()
        limit = None if final else self.recipe.eval.max_queries
        metrics = rank_split(self.model, self.kg, split, self.recipe, self.index, self.reporter, max_queries=limit)
        record = {
            "kind": "eval",
            "split": split,
            "step": self.step_count,
            "epoch": self.epoch,
            "seconds": round(time.perf_counter() - started, 2),
            **{side: m.as_dict() for side, m in metrics.items()},
        }
        self.metrics.log(record)
        return metrics

    # -- checkpoints and cleanup -------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        trainer = {
            "step": self.step_count,
            "epoch": self.epoch,
            "batch": self.batch,
            "window": self.window,
            "epoch_loss": self.epoch_loss,
            "optimizer_ram": self.optimizer_ram,
            "metrics_records": self.metrics.records,
            "skipped_steps": getattr(self.optimizer, "skipped_steps", 0),
        }
        return save_checkpoint(
            self.run.checkpoints, self.step_count, self.model, self.optimizer, trainer, keep=self.recipe.train.keep_checkpoints
        )

    def _state_bytes_on_disk(self) -> int:
        state_dir = self.run.state_dir(self.recipe)
        if not state_dir.is_dir():
            return 0
        return sum(p.stat().st_blocks * 512 for p in state_dir.iterdir() if p.is_file())

    def close(self) -> None:
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "optimizer"):
            close_optimizer(self.optimizer)


def known_triples(kg: KnowledgeGraph) -> TripleIndex:
    """Every true triple of every split: what filtered ranking filters out."""
    return TripleIndex(torch.cat([kg.train, kg.valid, kg.test]), kg.num_entities, kg.num_relations)


def rank_split(
    model: KGEModel,
    kg: KnowledgeGraph,
    split: str,
    recipe: Recipe,
    index: TripleIndex,
    reporter: Reporter,
    *,
    max_queries: int | None = None,
) -> dict[str, RankingMetrics]:
    """Filtered ranking metrics of one split (or of a seeded sample of ``max_queries`` triples)."""
    cfg = recipe.eval
    triples = kg.split(split)
    if max_queries is not None and len(triples) > max_queries:
        pick = torch.randperm(len(triples), generator=torch.Generator().manual_seed(recipe.train.seed))
        triples = triples[pick[:max_queries]]
    reporter.eval_start(split, 2 * len(triples))
    model.eval()
    metrics = evaluate_link_prediction(
        model.score_entities,
        triples,
        index,
        num_entities=kg.num_entities,
        batch_size=cfg.batch_size,
        entity_chunk=cfg.entity_chunk,
        sampled_negatives=cfg.sampled_negatives,
        seed=recipe.train.seed,
        progress=reporter.eval_advance,
    )
    reporter.eval_done(split, metrics)
    return metrics


def evaluate_run(
    run: RunFolder, split: str, *, checkpoint: int | None = None, device: str | None = None, reporter: Reporter | None = None
) -> tuple[Path, dict[str, RankingMetrics]]:
    """Rank ``split`` with the model of a run's checkpoint (the newest by default)."""
    reporter = reporter or SilentReporter()
    recipe = run.read_config([f"train.device={device}"] if device else [])
    path, _, damaged = find_checkpoint(run.checkpoints, checkpoint)
    for warning in damaged:
        reporter.note(f"warning: {warning}")
    kg = load_knowledge_graph(recipe.dataset)
    model = build_kge_model(recipe.model, kg.num_entities, kg.num_relations)
    load_model_state(path, model)
    model.to(resolve_device(recipe.train.device))
    return path, rank_split(model, kg, split, recipe, known_triples(kg), reporter)
