"""Click prediction end to end: the metrics against brute force, DLRM against a hand-written
forward pass, the generator's planted signal, the click-log reader, and training runs (both
optimizers equal, disk tables, eval, exact resume)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.data import load_click_log
from dsa_train.data.fingerprint import fingerprint_of
from dsa_train.errors import ConfigError, DatasetError
from dsa_train.eval.clicks import auc, base_entropy, click_metrics, log_loss
from dsa_train.models.recsys import DLRM, table_rows
from dsa_train.recipe import ClickColumnsConfig, ClicksSyntheticConfig, DatasetConfig, parse_recipe
from dsa_train.train import loop
from dsa_train.runs.run_folder import MetricsLog

from .helpers import error_at_step

REPO_RECIPES = __import__("pathlib").Path(__file__).resolve().parent.parent / "recipes"

RECIPE = """\
name: clicks
dataset:
  kind: synthetic_clicks
  clicks: {{samples: 6000, valid: 1000, test: 1000, features: 4, ids: 500, dense: 3, max_hot: 3, weighted: true, seed: 3}}
model:
  kind: dlrm
  dim: 8
  init_std: 0.01
  embedding_storage: {storage}
  recsys: {{rows: 400, bottom: [16], top: [16]}}
train: {{epochs: 2, batch_size: 256, log_every: 4, checkpoint_every: 10, keep_checkpoints: 2}}
optimizer: {{kind: {optimizer}, lr: 0.01, dense_lr: 0.003}}
eval: {{every_epochs: 1, final_splits: [valid, test]}}
"""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def write(tmp_path, optimizer="dsa", storage="memory"):
    path = tmp_path / f"clicks-{optimizer}-{storage}.yaml"
    path.write_text(RECIPE.format(optimizer=optimizer, storage=storage))
    return path


def records(run, kind):
    timings = MetricsLog.MACHINE_FIELDS
    return [
        {k: v for k, v in r.items() if k not in timings}
        for r in MetricsLog.read(run / "metrics.jsonl")
        if r["kind"] == kind
    ]


# -- metrics --------------------------------------------------------------------------------


def brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_equals_the_pairwise_count_with_ties():
    g = torch.Generator().manual_seed(1)
    for n in (2, 7, 60, 301):
        scores = torch.randint(0, 9, (n,), generator=g).double() / 4  # many ties
        labels = torch.randint(0, 2, (n,), generator=g)
        labels[0], labels[1] = 0, 1
        assert auc(scores, labels) == pytest.approx(brute_force_auc(scores.tolist(), labels.tolist()), abs=1e-12)
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0, 1])) == 1.0
    assert math.isnan(auc(torch.tensor([0.1, 0.9]), torch.tensor([1, 1])))


def test_log_loss_and_normalized_entropy_by_hand():
    logits, labels = torch.tensor([0.0, 2.0, -1.0, 30.0]), torch.tensor([1.0, 0.0, 0.0, 1.0])
    p = [0.5, 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(1)), 1 / (1 + math.exp(-30))]
    hand = -(math.log(p[0]) + math.log(1 - p[1]) + math.log(1 - p[2]) + math.log(p[3])) / 4
    assert log_loss(logits, labels) == pytest.approx(hand, rel=1e-12)
    assert base_entropy(labels) == pytest.approx(math.log(2))
    m = click_metrics(logits, labels, true_logits=torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert (
        m["normalized_entropy"] == pytest.approx(hand / math.log(2)) and m["best_auc"] == 1.0 and m["click_rate"] == 0.5
    )


# -- the model --------------------------------------------------------------------------------


def test_table_rows_per_feature_and_shared():
    values, feature = torch.tensor([0, 7, 12, 12, 12]), torch.tensor([0, 0, 0, 1, 2])
    assert table_rows(values, feature, features=3, rows=10, shared=False).tolist() == [0, 7, 2, 12, 22]
    shared = table_rows(values, feature, features=3, rows=10, shared=True)
    assert shared.min() >= 0 and shared.max() < 10
    assert torch.equal(shared, table_rows(values, feature, features=3, rows=10, shared=True))  # a fixed hash
    many = table_rows(torch.full((3000,), 5), torch.arange(3000) % 3, features=3, rows=1000, shared=True)
    assert len(set(many.tolist())) == 3  # a value's rows differ between features


@pytest.mark.parametrize("interaction", ["dot", "cat"])
@pytest.mark.parametrize("dense", [3, 0])
def test_dlrm_forward_equals_a_hand_written_one(interaction, dense):
    torch.manual_seed(0)
    f, dim = 3, 4
    model = DLRM(
        50, dim, features=f, dense=dense, bottom=[5], top=[6], interaction=interaction, mode="sum", init_std=0.5
    ).double()
    x = torch.randn(2, dense, dtype=torch.double)
    bags = [[1, 2], [], [3], [4, 4, 5], [6], [7, 8]]  # 2 impressions x 3 features
    weights = torch.rand(sum(map(len, bags)), dtype=torch.double)
    rows = torch.tensor([r for bag in bags for r in bag])
    offsets = torch.tensor([0, *np.cumsum([len(b) for b in bags])[:-1]])
    got = model(x, rows, offsets, weights)
    table, expected, k = model.table.weight.detach(), [], 0
    for sample in range(2):
        pooled = []
        for bag in bags[sample * f : (sample + 1) * f]:
            pooled.append(
                sum((weights[k + j] * table[r] for j, r in enumerate(bag)), torch.zeros(dim, dtype=torch.double))
            )
            k += len(bag)
        if dense:
            lin = [m for m in model.bottom if isinstance(m, torch.nn.Linear)]
            e0 = lin[1](torch.relu(lin[0](x[sample])))
        else:
            e0 = model.constant
        vectors = [e0, *pooled]
        if interaction == "dot":
            h = torch.cat(
                [e0, torch.stack([vectors[a] @ vectors[b] for a in range(f + 1) for b in range(a + 1, f + 1)])]
            )
        else:
            h = torch.cat(vectors)
        lin = [m for m in model.top if isinstance(m, torch.nn.Linear)]
        expected.append(lin[1](torch.relu(lin[0](h)))[0])
    assert torch.allclose(got, torch.stack(expected), atol=1e-12)


def test_a_table_without_bags_pools_the_same():
    """A checkpoint's table is read row by row (no bags): pooled the same as an EmbeddingBag."""
    torch.manual_seed(0)
    model = DLRM(30, 4, features=2, dense=0, bottom=[], top=[3], mode="mean", init_std=1.0)
    rows, offsets = torch.tensor([1, 2, 2, 9, 4]), torch.tensor([0, 3, 3, 4])
    bagged = model.pooled(rows, offsets, None)
    plain = torch.nn.Embedding(30, 4)
    plain.weight.data.copy_(model.table.weight.data)
    model.table = plain
    assert torch.allclose(model.pooled(rows, offsets, None), bagged, atol=1e-6)
    assert torch.equal(bagged[1], torch.zeros(4))  # an empty bag pools to zeros


# -- the generator -----------------------------------------------------------------------------


def generated(tmp_path, **settings):
    config = DatasetConfig(kind="synthetic_clicks", root=str(tmp_path), clicks=ClicksSyntheticConfig(**settings))
    return load_click_log(config)


def test_generator_is_seeded_power_law_and_learnable(tmp_path):
    settings = dict(
        samples=40_000, valid=0, test=20_000, features=4, ids=1000, dense=2, max_hot=2, weighted=True, seed=5
    )
    log = generated(tmp_path / "a", **settings)
    again = generated(tmp_path / "b", **settings)
    for name in ("train_ids", "test_labels", "test_weights", "train_dense"):
        assert np.array_equal(log.dataset.array(name), again.dataset.array(name)), name
    assert log.samples == {"train": 40_000, "valid": 0, "test": 20_000}
    ids = log.dataset.array("train_ids")
    assert ids.min() >= 0 and ids.max() < 1000
    counts = np.sort(np.bincount(ids, minlength=1000))[::-1]
    assert counts[:10].sum() > 10 * counts[500:510].sum()  # popular ids dominate (power law)
    lengths = np.diff(log.dataset.array("train_bags"))
    assert set(np.unique(lengths)) == {1, 2}
    w = log.dataset.array("train_weights")
    assert w.min() > 0 and w.max() <= 1
    batch = log.batch("test", torch.arange(20_000))
    best = auc(batch.logits, batch.labels)
    assert 0.75 < best < 0.95  # the planted signal decides the clicks
    # the clicks follow the true probabilities: their mean matches within sampling noise
    assert abs(float(torch.sigmoid(batch.logits).mean() - batch.labels.mean())) < 0.015
    noise = generated(tmp_path / "c", **{**settings, "signal": 0.0})
    nb = noise.batch("test", torch.arange(20_000))
    assert abs(nb.labels.mean().item() - 0.25) < 0.015  # no signal: coin flips at click_rate


def test_batch_gathers_the_bags_of_the_picked_impressions(tmp_path):
    log = generated(tmp_path, samples=50, valid=0, test=0, features=3, ids=100, dense=1, max_hot=3, seed=2)
    bags, ids = log.dataset.array("train_bags"), log.dataset.array("train_ids")
    picked = torch.tensor([7, 2, 7, 49])
    batch = log.batch("train", picked)
    expected_ids, expected_feature = [], []
    for s in picked.tolist():
        for f in range(3):
            b = s * 3 + f
            expected_ids += ids[bags[b] : bags[b + 1]].tolist()
            expected_feature += [f] * int(bags[b + 1] - bags[b])
    assert batch.ids.tolist() == expected_ids and batch.feature.tolist() == expected_feature
    lengths = [int(bags[s * 3 + f + 1] - bags[s * 3 + f]) for s in picked.tolist() for f in range(3)]
    assert batch.offsets.tolist() == [0, *np.cumsum(lengths)[:-1].tolist()]
    assert (
        batch.dense.shape == (4, 1)
        and batch.labels.tolist() == log.dataset.array("train_labels")[picked.numpy()].tolist()
    )


# -- the click-log reader ------------------------------------------------------------------------


def click_log(tmp_path, lines, name="log.tsv", **columns):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    config = DatasetConfig(
        kind="click_log", path=str(path), root=str(tmp_path / "root"), columns=ClickColumnsConfig(**columns)
    )
    return load_click_log(config)


def value_of(raw: str) -> int:
    return fingerprint_of(raw.encode())[0] >> 1


def test_criteo_layout_is_read_hashed_and_held_out_in_file_order(tmp_path):
    lines = ["label\tI1\tI2\tC1\tC2"] + [f"{i % 2}\t{i}\t\tab{i % 3}\t{'' if i == 4 else 'x|y'}" for i in range(10)]
    log = click_log(tmp_path, lines, holdout=(0.2, 0.3))
    assert log.features == ["C1", "C2"] and log.dense_features == ["I1", "I2"]
    assert log.samples == {"train": 5, "valid": 2, "test": 3}
    assert log.dataset.array("train_labels").tolist() == [0, 1, 0, 1, 0]
    assert log.dataset.array("test_labels").tolist() == [1, 0, 1]  # the last 3 lines
    dense = log.dataset.array("valid_dense")
    assert np.allclose(dense[:, 0], np.log1p([5, 6])) and np.all(dense[:, 1] == 0)  # log(1 + x); empty: 0
    batch = log.batch("train", torch.arange(5))
    expected = []
    for i in range(5):
        expected.append(value_of(f"ab{i % 3}"))
        expected += [] if i == 4 else [value_of("x"), value_of("y")]
    assert batch.ids.tolist() == expected  # fingerprints of the raw values; an empty cell: an empty bag
    assert batch.offsets.tolist() == [0, 1, 3, 4, 6, 7, 9, 10, 12, 13]


def test_csv_with_weights_quotes_and_named_columns(tmp_path):
    lines = ['click,price,"city, country",tags', '1,3.5,"Oslo, NO",a:0.5|b:2', "0,-1,Rome,"]
    log = click_log(
        tmp_path,
        lines,
        name="log.csv",
        label="click",
        dense=["price"],
        sparse=["city, country", "tags"],
        weights=True,
        dense_log=False,
        holdout=(0.0, 0.0),
    )
    batch = log.batch("train", torch.arange(2))
    assert batch.ids.tolist() == [value_of("Oslo, NO"), value_of("a"), value_of("b"), value_of("Rome")]
    assert batch.weights.tolist() == [1.0, 0.5, 2.0, 1.0]
    assert batch.dense[:, 0].tolist() == [3.5, -1.0]


@pytest.mark.parametrize(
    "lines,columns,message",
    [
        (["label\tI1\tC9", "1\t2\tx"], {"sparse": ["C1"]}, "has no column 'C1' (its header: label, I1, C9)"),
        (["label\tI1\tC1", "1\t2\tx", "2\t2\tx"], {}, "line 3: label '2' in column 'label' is not 0 or 1"),
        (["label\tI1\tC1", "1\t2"], {}, "line 2: 2 cells where the header names 3"),
        (["label\tI1\tC1", "1\tfive\tx"], {}, "line 2: dense value 'five' is not a number"),
        (["label\tI1", "1\t2"], {}, "has no categorical column"),
        (["label\tC1", "1\tx:heavy"], {"weights": True}, "line 2: weight 'heavy' of a value is not a number"),
    ],
)
def test_bad_click_logs_name_the_line_the_value_and_the_fix(tmp_path, lines, columns, message):
    with pytest.raises(DatasetError) as e:
        click_log(tmp_path, lines, **columns)
    assert message in e.value.message and e.value.hint


def test_a_missing_file_and_a_changed_file(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_click_log(DatasetConfig(kind="click_log", path=str(tmp_path / "none.tsv")))
    first = click_log(tmp_path, ["label\tC1", "1\ta", "0\tb"], holdout=(0.0, 0.0))
    assert first.samples["train"] == 2
    again = click_log(
        tmp_path, ["label\tC1", "1\ta", "0\tb", "1\tc"], holdout=(0.0, 0.0)
    )  # the file changed: imported anew
    assert again.samples["train"] == 3


# -- recipes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,message",
    [
        (
            "dataset: {kind: karate}",
            "'dlrm' trains on a click log (click_log, synthetic_clicks), not dataset kind 'karate'",
        ),
        ("train: {order: partitioned}", "'partitioned' trains knowledge-graph models and node2vec, not 'dlrm'"),
        ("dataset: {kind: click_log}", "is required for kind 'click_log'"),
        ("dataset: {kind: synthetic_clicks, columns: {multi_hot: '||'}}", "must be one character"),
        (
            "model: {kind: dlrm, embedding_storage: disk}\noptimizer: {kind: sparse_adam}",
            "'sparse_adam' cannot train a disk table",
        ),
    ],
)
def test_recipe_refusals(change, message):
    base = {"model": {"kind": "dlrm"}, "dataset": {"kind": "synthetic_clicks"}}
    import yaml

    override = yaml.safe_load(change)
    data = {**base, **{k: {**base.get(k, {}), **v} for k, v in override.items()}}
    with pytest.raises(ConfigError) as e:
        parse_recipe(yaml.safe_dump(data))
    assert message in str(e.value)


def test_mean_pooling_refuses_weighted_bags(tmp_path):
    result = invoke("run", write(tmp_path), "--output", tmp_path / "run", "--set", "model.recsys.mode=mean")
    assert (
        result.exit_code != 0
        and "model.recsys.mode: 'mean' cannot take the click log's per-id weights" in result.output
    )


# -- training ---------------------------------------------------------------------------------------


def test_disk_sparse_adam_trains_dlrm_exactly_as_sparse_adam(tmp_path):
    runs = {}
    for optimizer in ("dsa", "sparse_adam"):
        runs[optimizer] = tmp_path / optimizer
        result = invoke("run", write(tmp_path, optimizer), "--output", runs[optimizer])
        assert result.exit_code == 0, result.output
    for kind in ("train", "eval"):
        assert records(runs["dsa"], kind) == records(runs["sparse_adam"], kind), kind
    final = records(runs["dsa"], "summary")[0]["final"]["test"]["clicks"]
    # it learns the planted signal: far above chance, below the true probabilities' AUC
    assert 0.6 < final["auc"] < final["best_auc"] and final["normalized_entropy"] < 1


def test_disk_table_run_eval_and_exact_resume(tmp_path):
    path = write(tmp_path, storage="disk")
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    result = invoke("run", path, "--output", whole)
    assert result.exit_code == 0, result.output
    assert (whole / "tables" / "features.table").is_file()

    with error_at_step(15):  # after the checkpoint of step 10
        assert invoke("run", path, "--output", broken).exit_code == 1
    assert invoke("run", path, "--output", broken, "--resume").exit_code == 0
    for kind in ("train", "epoch", "eval", "summary"):
        got, want = records(broken, kind), records(whole, kind)
        for r in got + want:
            r.pop("tables_on_disk_mib", None), r.pop("optimizer_state_on_disk_mib", None)
        assert got == want, kind
    evaluated = invoke("eval", whole, "--split", "test")
    assert evaluated.exit_code == 0, evaluated.output
    test = records(whole, "summary")[0]["final"]["test"]["clicks"]
    assert f"AUC {test['auc']:.4f}" in evaluated.output


@pytest.mark.slow
def test_recsys_quickstart_recipe(tmp_path):
    out = tmp_path / "run"
    result = invoke("run", REPO_RECIPES / "recsys-quickstart.yaml", "--output", out)
    assert result.exit_code == 0, result.output
    test = records(out, "summary")[0]["final"]["test"]["clicks"]
    assert test["auc"] > 0.72 and test["best_auc"] - test["auc"] < 0.12


def test_the_prefetched_batch_is_the_one_trained(tmp_path, monkeypatch):
    """With a disk table the loop announces each next batch; the task gathers it then and
    trains on that gathering (once per step, not twice): the losses equal those of gathering
    every batch afresh."""
    from dsa_train.data.clicks import ClickLog
    from dsa_train.train.recsys import RecsysTask

    path = write(tmp_path, storage="disk")
    real_batch, gathered = ClickLog.batch, []

    def counted(self, split, samples):
        gathered.append(split)
        return real_batch(self, split, samples)

    monkeypatch.setattr(ClickLog, "batch", counted)
    assert invoke("run", path, "--output", tmp_path / "cached", "--set", "train.epochs=1").exit_code == 0
    steps = records(tmp_path / "cached", "summary")[0]["step"]
    assert gathered.count("train") == steps  # each step's batch gathered once, when announced
    real_prefetch = RecsysTask.prefetch

    def forgetful(self, picked):
        real_prefetch(self, picked)
        self._gathered = []

    monkeypatch.setattr(RecsysTask, "prefetch", forgetful)
    gathered.clear()
    assert invoke("run", path, "--output", tmp_path / "afresh", "--set", "train.epochs=1").exit_code == 0
    assert gathered.count("train") == 2 * steps - 1
    assert records(tmp_path / "cached", "train") == records(tmp_path / "afresh", "train")


def test_rates_set_on_resume_reach_both_optimizers(tmp_path, monkeypatch):
    """``--resume --set optimizer.lr=... --set optimizer.dense_lr=...``: the sparse tables and
    the dense layers train on at the new rates, as an uninterrupted run whose rates changed
    after the checkpoint of step 10 does."""
    path = write(tmp_path)
    switched, resumed = tmp_path / "switched", tmp_path / "resumed"
    real_step = loop.Training.step

    def switch_after_10(self, picked):
        if self.step_count == 10:
            for optimizer, rate in ((self.optimizer, 0.003), (self.dense_optimizer, 0.002)):
                for group in optimizer.param_groups:
                    group["lr"] = rate
        return real_step(self, picked)

    monkeypatch.setattr(loop.Training, "step", switch_after_10)
    assert invoke("run", path, "--output", switched).exit_code == 0
    monkeypatch.setattr(loop.Training, "step", real_step)
    with error_at_step(15):
        assert invoke("run", path, "--output", resumed).exit_code == 1
    result = invoke(
        "run", path, "--output", resumed, "--resume", "--set", "optimizer.lr=0.003", "--set", "optimizer.dense_lr=0.002"
    )
    assert result.exit_code == 0, result.output
    for kind in ("train", "summary"):
        got, want = records(resumed, kind), records(switched, kind)
        for r in got + want:
            r.pop("tables_on_disk_mib", None), r.pop("optimizer_state_on_disk_mib", None)
        assert got == want, kind
