"""Approximate neighbours through faiss (``neighbors(approximate=...)``, ``--approximate``),
checked against brute-force answers computed here from the weights."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from dsa_train import DsaError, open_run
from dsa_train.cli.app import app
from dsa_train.results import ann

from .test_results import entity_name, graph, runs  # noqa: F401  (module fixtures: one trained run for this file)


class TableRun:
    """Just what ``ann.open_index`` reads of a run, over a table held here: a table larger
    than the trained test runs' 60 rows, so that an IVF index really approximates."""

    def __init__(self, folder: Path, weights: torch.Tensor, step: int = 7) -> None:
        self.run, self.step, self.w = SimpleNamespace(path=folder), step, weights
        self.tables = {"nodes": tuple(weights.shape)}

    def chunks(self, table, chunk_rows=1000):
        for start in range(0, len(self.w), chunk_rows):
            yield start, self.w[start : start + chunk_rows].clone()

    def gather(self, table, ids):
        return self.w[ids].clone()


def brute_top(weights: torch.Tensor, rows: torch.Tensor, k: int, metric: str) -> torch.Tensor:
    """The exact ``k`` nearest rows of ``weights[rows]``, each row left out of its own answer."""
    w = torch.nn.functional.normalize(weights, dim=1) if metric == "cosine" else weights
    q = w[rows]
    scores = -torch.cdist(q.double(), w.double()) if metric == "l2" else (q.double() @ w.double().T)
    scores[torch.arange(len(rows)), rows] = float("-inf")
    return torch.topk(scores, k, dim=1).indices


def test_a_flat_index_answers_exactly_in_the_models_metric(runs, tmp_path, notes):  # noqa: F811
    import faiss  # the test extra installs it: its absence fails, never skips

    trained = open_run(runs())
    assert trained.default_metric == "l2"  # TransE, p_norm 2
    notes.clear()
    index = trained.ann_index()
    assert (index.manifest["metric"], index.manifest["kind"], index.built) == (
        "l2",
        "flat",
        True,
    )  # 60 rows: flat by default
    assert "recall@10 1.000" in notes[0] and index.recall == 1.0
    assert index.path == trained.run.path / "ann" / "entities.l2.ann" and index.index.metric_type == faiss.METRIC_L2
    for metric in ("l2", "cosine", "dot"):
        exact = trained.neighbors(entity_name(9), k=6, metric=metric)
        approximate = trained.neighbors(entity_name(9), k=6, metric=metric, approximate=True)
        assert [a.id for a in approximate] == [a.id for a in exact]
        assert [a.score for a in approximate] == pytest.approx([a.score for a in exact], abs=1e-5)
    again = trained.ann_index("entities", "l2")
    assert not again.built and again.manifest == index.manifest  # the saved index is reused, not rebuilt


def test_recall_is_the_share_of_the_exact_top_10_found(tmp_path):
    import faiss  # the test extra installs it: its absence fails, never skips

    weights = torch.randn(5000, 16, generator=torch.Generator().manual_seed(5))
    for metric in ("cosine", "l2"):
        table = TableRun(tmp_path / metric, weights)
        index = ann.open_index(table, "nodes", metric, kind="ivf")
        sample = torch.randperm(5000, generator=torch.Generator().manual_seed(1))[
            : ann.RECALL_QUERIES
        ]  # the rows it measured on
        exact = brute_top(weights, sample, 10, metric)
        _, found = index.search(weights[sample], 11)
        hits = sum(
            len(set([i for i in f if i != own][:10]) & set(e))
            for f, e, own in zip(found.tolist(), exact.tolist(), sample.tolist())
        )
        assert index.recall == pytest.approx(hits / (10 * len(sample)))
        assert 0.3 < index.recall < 1.0  # an IVF index over random vectors misses some: the figure is not a constant
        assert isinstance(index.index, faiss.IndexIVFFlat)
    hnsw = ann.open_index(TableRun(tmp_path / "hnsw", weights), "nodes", "dot", kind="hnsw")
    assert isinstance(hnsw.index, faiss.IndexHNSWFlat) and hnsw.index.metric_type == faiss.METRIC_INNER_PRODUCT


def test_search_effort_trades_time_for_recall_measured_again(tmp_path, notes):
    import faiss  # noqa: F401  (the test extra installs it: its absence fails, never skips)

    weights = torch.randn(5000, 16, generator=torch.Generator().manual_seed(5))
    sample = torch.randperm(5000, generator=torch.Generator().manual_seed(1))[: ann.RECALL_QUERIES]
    exact = brute_top(weights, sample, 10, "l2")

    def recall_of(index) -> float:
        _, found = index.search(weights[sample], 11)
        return sum(
            len(set([i for i in f if i != own][:10]) & set(e))
            for f, e, own in zip(found.tolist(), exact.tolist(), sample.tolist())
        ) / (10 * len(sample))

    for kind, setting, low, high in (("ivf", "probes", 1, 10_000), ("hnsw", "ef_search", 1, 400)):
        notes.clear()
        table = TableRun(tmp_path / kind, weights)
        default = ann.open_index(table, "nodes", "l2", kind=kind)
        coarse = ann.open_index(table, "nodes", "l2", effort=low)
        assert not coarse.built and coarse.manifest[setting] == low and f"{setting} {low}" in notes[-1]
        assert coarse.recall == pytest.approx(recall_of(coarse)) and coarse.recall < default.recall
        fine = ann.open_index(table, "nodes", "l2", effort=high)
        assert fine.recall == pytest.approx(recall_of(fine)) and fine.recall >= default.recall
        if kind == "ivf":
            assert fine.manifest["probes"] == fine.manifest["lists"] and fine.recall == 1.0  # every list probed: exact
        assert ann._read_manifest(default.path)[setting] == default.manifest[setting]  # a search setting, not saved
    with pytest.raises(DsaError, match="applies to ivf and hnsw"):
        ann.open_index(TableRun(tmp_path / "flat", weights), "nodes", "l2", kind="flat", effort=5)
    with pytest.raises(DsaError, match="at least 1"):
        ann.open_index(TableRun(tmp_path / "ivf", weights), "nodes", "l2", effort=0)


def test_a_stale_index_is_rebuilt_never_used(tmp_path, notes):
    import faiss  # noqa: F401  (the test extra installs it: its absence fails, never skips)

    weights = torch.randn(300, 8, generator=torch.Generator().manual_seed(2))
    notes.clear()
    first = ann.open_index(TableRun(tmp_path, weights, step=7), "nodes", "dot")
    moved = weights.flip(0)  # a later checkpoint: other rows under the same ids
    later = ann.open_index(TableRun(tmp_path, moved, step=9), "nodes", "dot")
    assert (
        later.built and later.manifest["checkpoint"] == 9 and "made for run" in notes[1] and "checkpoint 7" in notes[1]
    )
    _, ids = later.search(moved[:1], 1)
    assert ids.item() == int((moved @ moved[0]).argmax())  # answers from the new rows, not the old index's
    assert first.path == later.path and not ann.open_index(TableRun(tmp_path, moved, step=9), "nodes", "dot").built
    retrained = ann.open_index(TableRun(tmp_path, moved * 2, step=9), "nodes", "dot")
    assert retrained.built and "rows digest" in notes[-2]  # same folder, step and shape, other rows: rebuilt
    hnsw = ann.open_index(TableRun(tmp_path, moved, step=9), "nodes", "dot", kind="hnsw")
    assert hnsw.built and hnsw.manifest["kind"] == "hnsw"  # another index type asked for: rebuilt


def test_bad_input_gets_named_errors(runs, tmp_path):  # noqa: F811
    import faiss  # noqa: F401  (the test extra installs it: its absence fails, never skips)

    trained = open_run(runs())
    with pytest.raises(DsaError, match="supports the metrics cosine, dot, l2, not 'l1'"):
        trained.ann_index(metric="l1")
    with pytest.raises(DsaError, match="index type must be one of flat, ivf, hnsw"):
        trained.ann_index(kind="lsh")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "entities.l2.ann").write_text("someone's notes")
    with pytest.raises(DsaError, match="is not an index dsa-train saved"):
        trained.ann_index(folder=foreign)
    assert (foreign / "entities.l2.ann").read_text() == "someone's notes"
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "linked").symlink_to(real)
    with pytest.raises(DsaError, match="is a symbolic link"):
        trained.ann_index(folder=tmp_path / "linked")
    assert list(real.iterdir()) == []
    cosine = trained.ann_index(metric="cosine", folder=tmp_path / "own")
    with pytest.raises(DsaError, match="the index given is of entities in cosine"):
        trained.neighbors(entity_name(9), metric="l2", approximate=cosine)


def test_a_failed_save_leaves_nothing_under_the_name(tmp_path, monkeypatch):
    import faiss  # the test extra installs it: its absence fails, never skips

    def full_disk(index):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(faiss, "serialize_index", full_disk)
    with pytest.raises(DsaError, match="cannot save the index to .*No space left"):
        ann.open_index(TableRun(tmp_path, torch.randn(50, 4)), "nodes", "dot")
    assert list((tmp_path / "ann").iterdir()) == []  # neither the index nor its temporary


def test_missing_faiss_says_how_to_install_it(runs, monkeypatch):  # noqa: F811
    monkeypatch.setitem(__import__("sys").modules, "faiss", None)  # import faiss now raises ImportError
    with pytest.raises(DsaError, match="needs faiss") as raised:
        open_run(runs()).neighbors(entity_name(9), approximate=True)
    assert 'pip install "dsa-train[faiss]"' in raised.value.hint


def test_approximate_neighbors_from_the_command_line(runs, tmp_path):  # noqa: F811
    import faiss  # noqa: F401  (the test extra installs it: its absence fails, never skips)

    run = runs()
    name = entity_name(9)
    result = CliRunner().invoke(
        app, ["neighbors", str(run), name, "-k", "4", "--approximate", "--index-dir", str(tmp_path / "i"), "--json"]
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert [a["id"] for a in document["neighbors"]] == [a.id for a in open_run(run).neighbors(name, k=4)]
    assert document["index"]["kind"] == "flat" and document["index"]["recall_at_10"] == 1.0
    assert "recall@10 1.000" in result.stderr
    refused = CliRunner().invoke(app, ["neighbors", str(run), name, "--approximate", "--metric", "l1"])
    assert refused.exit_code != 0 and "cosine, dot, l2" in refused.output and "Traceback" not in refused.output
    stray = CliRunner().invoke(app, ["neighbors", str(run), name, "--index-type", "hnsw"])
    assert stray.exit_code != 0 and "add --approximate" in stray.output
    stray = CliRunner().invoke(app, ["neighbors", str(run), name, "--effort", "64"])
    assert stray.exit_code != 0 and "add --approximate" in stray.output
