"""What a finished run gives back (dsa_train.open_run, dsa-train export), checked against the
checkpoint's own tensors and brute-force answers computed here from the weights."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dsa_train import DsaError, open_run
from dsa_train.cli.app import app
from dsa_train.nn import DiskEmbedding
from dsa_train.results import export_run

ENTITIES, RELATIONS = 60, 4
RECIPE = """\
name: named
dataset: {kind: tsv, path: %(data)s}
model: {kind: %(model)s, dim: 8, init_std: 0.1, embedding_storage: %(storage)s}
train: {epochs: 2, batch_size: 64, negatives: 16, checkpoint_every: 3, keep_checkpoints: 2, log_every: 100}
optimizer: {kind: dsa, lr: 0.05}
eval: {every_epochs: 0, final_splits: []}
"""


def entity_name(i: int) -> str:
    return f"ñandú/{i:03d}" if i % 7 else f"Q{i}"


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """A small named TSV graph: (folder, every true triple as names)."""
    folder = tmp_path_factory.mktemp("named-kg")
    g = torch.Generator().manual_seed(3)
    triples = set()
    for i in range(ENTITIES):  # every entity in train
        triples.add((i, i % RELATIONS, (i * 7 + 1) % ENTITIES))
    while len(triples) < 600:
        h, r, t = (
            torch.randint(0, ENTITIES, (1,), generator=g).item(),
            torch.randint(0, RELATIONS, (1,), generator=g).item(),
            torch.randint(0, ENTITIES, (1,), generator=g).item(),
        )
        triples.add((h, r, t))
    ordered = sorted(triples)
    splits = {"train": ordered[:520], "valid": ordered[520:560], "test": ordered[560:]}
    for split, rows in splits.items():
        (folder / f"{split}.txt").write_text(
            "".join(f"{entity_name(h)}\tr{r}\t{entity_name(t)}\n" for h, r, t in rows), encoding="utf-8"
        )
    return folder, {(entity_name(h), f"r{r}", entity_name(t)) for h, r, t in ordered}


@pytest.fixture(scope="module")
def runs(graph, tmp_path_factory):
    """One finished run per (model, storage), trained once for the module."""
    made = {}

    def run(model="transe", storage="memory", *overrides):
        if (model, storage, overrides) not in made:
            folder = tmp_path_factory.mktemp(f"run-{model}-{storage}")
            recipe = folder / "recipe.yaml"
            recipe.write_text(RECIPE % {"data": graph[0], "model": model, "storage": storage})
            sets = [arg for override in overrides for arg in ("--set", override)]
            result = CliRunner().invoke(app, ["run", str(recipe), "-o", str(folder / "run"), *sets])
            assert result.exit_code == 0, result.output
            made[(model, storage, overrides)] = folder / "run"
        return made[(model, storage, overrides)]

    return run


def newest_checkpoint(run):
    return sorted(p for p in (run / "checkpoints").iterdir() if p.name.isdigit())[-1]


def test_memory_tables_are_the_checkpoints_tensors(runs):
    run = runs("transe", "memory")
    trained = open_run(run)
    saved = torch.load(newest_checkpoint(run) / "model.pt", weights_only=True)
    assert trained.step == int(newest_checkpoint(run).name)
    assert torch.equal(trained.weights("entities"), saved["node_emb.weight"])
    assert torch.equal(trained.weights("relations"), saved["rel_emb.weight"])
    assert trained.tables == {
        "entities": (ENTITIES, 8),
        "relations": (2 * RELATIONS, 8),
    }  # reciprocal: inverse rows too
    pieces = [rows for _, rows in trained.chunks("entities", chunk_rows=7)]
    assert torch.equal(torch.cat(pieces), saved["node_emb.weight"])


def test_disk_tables_read_through_delta_chains_equal_the_live_table(runs):
    """The run ended with a checkpoint, so its newest checkpoint (a delta on an earlier version)
    holds the live table's final weights."""
    run = runs("transe", "disk")
    trained = open_run(run)
    live = DiskEmbedding(ENTITIES, 8, path=run / "tables" / "entities.table", writable=False)
    assert torch.equal(trained.weights("entities"), live.weight)
    older = sorted(p for p in (run / "checkpoints").iterdir() if p.name.isdigit())[0]
    assert not torch.equal(open_run(run, checkpoint=int(older.name)).weights("entities"), live.weight)


def test_partition_ordered_tables_come_back_in_id_order(runs, tmp_path):
    """A partition-ordered run's table lies by slot; open_run and export give rows by id."""
    from dsa_train.data.buckets import EntityPartitions

    run = runs("transe", "disk", "train.order=partitioned", "train.partitions=3", "train.buffer=2")
    trained = open_run(run)
    live = DiskEmbedding(ENTITIES, 8, path=run / "tables" / "entities.table", writable=False)
    by_slot = live.weight.detach()
    slots = EntityPartitions(ENTITIES, 3, trained.recipe.train.seed).slots(torch.arange(ENTITIES))
    assert not torch.equal(slots, torch.arange(ENTITIES))  # the layout is not the identity
    assert torch.equal(trained.weights("entities"), by_slot[slots])
    export_run(trained, tmp_path / "out", "npy", chunk_rows=7)
    assert np.array_equal(np.load(tmp_path / "out" / "entities.npy"), by_slot[slots].numpy())


def test_names_round_trip(runs, graph):
    trained = open_run(runs())
    names = trained.names("entities")
    assert sorted(names) == sorted(entity_name(i) for i in range(ENTITIES))
    assert trained.ids("entities", names) == list(range(ENTITIES))
    relations = trained.names("relations")
    assert sorted(relations[:RELATIONS]) == [f"r{i}" for i in range(RELATIONS)]
    assert relations[RELATIONS:] == ["inverse:" + name for name in relations[:RELATIONS]]
    assert trained.ids("relations", relations) == list(range(2 * RELATIONS))
    with pytest.raises(DsaError, match="entity 'Q14x' is not in this run's entities") as err:
        trained.ids("entities", ["Q14x"])
    assert err.value.hint.startswith("did you mean 'Q14'")


def brute_scores(trained, head, relation) -> torch.Tensor:
    """TransE by hand: -||e_h + r - e_t||_2 for every tail."""
    e, r = trained.weights("entities"), trained.weights("relations")
    h, rel = trained.ids("entities", [head])[0], trained.ids("relations", [relation])[0]
    return -(e[h] + r[rel] - e).norm(dim=1)


def test_score_and_predict_against_brute_force(runs, graph):
    trained = open_run(runs())
    head, relation = entity_name(5), "r1"
    everything = brute_scores(trained, head, relation)
    names = trained.names("entities")
    tails = [names[i] for i in range(ENTITIES)]
    assert torch.allclose(trained.score([head] * ENTITIES, [relation] * ENTITIES, tails), everything, atol=1e-5)
    expected = torch.topk(everything, 10).indices.tolist()
    got = trained.predict(head=head, relation=relation, k=10, chunk_rows=7)
    assert [a.id for a in got] == expected and [a.name for a in got] == [names[i] for i in expected]
    # Filtered: every known (head, relation, ?) answer of any split is left out, or marked.
    known = {names.index(t) for h, r, t in graph[1] if h == head and r == relation}
    assert known
    masked = everything.clone()
    masked[list(known)] = float("-inf")
    assert [a.id for a in trained.predict(head=head, relation=relation, k=10, filter=True, chunk_rows=7)] == torch.topk(
        masked, 10
    ).indices.tolist()
    marked = trained.predict(head=head, relation=relation, k=ENTITIES, filter="mark")
    assert {a.id for a in marked if a.known} == known


def test_neighbors_against_brute_force(runs):
    trained = open_run(runs())
    e = trained.weights("entities")
    query = trained.ids("entities", [entity_name(9)])[0]
    cosine = torch.nn.functional.normalize(e, dim=1) @ torch.nn.functional.normalize(e[query], dim=0)
    cosine[query] = float("-inf")
    got = trained.neighbors(entity_name(9), k=5, metric="cosine", chunk_rows=8)
    assert [a.id for a in got] == torch.topk(cosine, 5).indices.tolist()
    l2 = -(e - e[query]).norm(dim=1)
    l2[query] = float("-inf")
    assert trained.default_metric == "l2"  # TransE with p_norm 2 scores distances
    assert [a.id for a in trained.neighbors(entity_name(9), k=5)] == torch.topk(l2, 5).indices.tolist()
    with pytest.raises(DsaError, match="metric must be one of"):
        trained.neighbors(entity_name(9), metric="manhattan")


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_export_round_trips_bit_for_bit(runs, tmp_path, storage):
    trained = open_run(runs("complex", storage))
    out = export_run(trained, tmp_path / "npy", "npy", chunk_rows=7)
    assert out["tables"]["entities"]["meaning"].startswith("complex vectors, columns [real parts | imaginary parts]")
    for table in ("entities", "relations"):
        assert np.array_equal(np.load(tmp_path / "npy" / f"{table}.npy"), trained.weights(table).numpy())
        lines = (tmp_path / "npy" / f"{table}.names.tsv").read_text(encoding="utf-8").splitlines()
        assert lines == [f"{i}\t{n}" for i, n in enumerate(trained.names(table))]
    manifest = json.loads((tmp_path / "npy" / "export.json").read_text())
    assert (
        manifest["checkpoint"] == trained.step
        and manifest["model"] == "complex"
        and manifest["tables"]["entities"]["rows"] == ENTITIES
    )
    export_run(trained, tmp_path / "tsv", "tsv")
    text = np.loadtxt(tmp_path / "tsv" / "entities.tsv", delimiter="\t", dtype=np.float32)
    assert np.array_equal(text, trained.weights("entities").numpy())  # 9 digits read back to the same bits


@pytest.mark.parametrize("normalized", [True, False])
def test_exported_vectors_score_as_the_model_does(runs, tmp_path, normalized):
    """TransE's stated meaning, -||e_h + r - e_t||_p, applied by hand to the exported vectors,
    gives the model's own scores; with normalize_entities the exported rows are the unit rows it
    scores, not the stored ones (which a scorer of the export would otherwise have to scale)."""
    trained = open_run(runs("transe", "memory", f"model.normalize_entities={str(normalized).lower()}"))
    manifest = export_run(trained, tmp_path / "npy", "npy")
    entities, relations = (torch.from_numpy(np.load(tmp_path / "npy" / f"{t}.npy")) for t in ("entities", "relations"))
    norms = entities.norm(dim=1)
    assert torch.allclose(norms, torch.ones(ENTITIES)) == normalized
    assert ("unit L2 norm" in manifest["tables"]["entities"]["meaning"]) == normalized
    h, r, t = torch.arange(ENTITIES), torch.arange(ENTITIES) % RELATIONS, torch.arange(ENTITIES).flip(0)
    by_hand = -(entities[h] + relations[r] - entities[t]).norm(p=manifest["settings"]["p_norm"], dim=1)
    torch.testing.assert_close(trained.score(h, r, t), by_hand)


def test_word2vec_text_follows_the_format(runs, tmp_path):
    """gensim's load_word2vec_format reads: a header 'count dim', then 'word v1 ... vdim' lines
    (https://radimrehurek.com/gensim/models/keyedvectors.html); names here hold no white space."""
    trained = open_run(runs())
    export_run(trained, tmp_path / "w2v", "word2vec")
    lines = (tmp_path / "w2v" / "entities.w2v.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0] == f"{ENTITIES} 8"
    words = [line.split(" ")[0] for line in lines[1:]]
    vectors = np.array([[np.float32(x) for x in line.split(" ")[1:]] for line in lines[1:]])
    assert words == trained.names("entities")
    assert np.array_equal(vectors, trained.weights("entities").numpy())


def test_export_refuses_what_is_not_its_own(runs, tmp_path):
    run = runs()
    target = tmp_path / "vectors"
    target.mkdir()
    (target / "precious.txt").write_text("mine")
    result = CliRunner().invoke(app, ["export", str(run), "-o", str(target)])
    assert result.exit_code == 1 and "already exists" in result.stderr and "Traceback" not in result.stderr
    result = CliRunner().invoke(app, ["export", str(run), "-o", str(target), "--force"])
    assert result.exit_code == 1 and "is not an earlier export" in result.stderr
    assert (target / "precious.txt").read_text() == "mine" and len(os.listdir(target)) == 1
    link = tmp_path / "link"
    link.symlink_to(target)
    result = CliRunner().invoke(app, ["export", str(run), "-o", str(link), "--force"])
    assert result.exit_code == 1 and "symbolic link" in result.stderr
    # An earlier export is replaced with --force, and nothing else is left beside it.
    fresh = tmp_path / "fresh"
    assert CliRunner().invoke(app, ["export", str(run), "-o", str(fresh)]).exit_code == 0
    result = CliRunner().invoke(app, ["export", str(run), "-o", str(fresh), "--force", "--format", "tsv"])
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(fresh)) == [
        "entities.names.tsv",
        "entities.tsv",
        "export.json",
        "relations.names.tsv",
        "relations.tsv",
    ]
    assert sorted(os.listdir(tmp_path)) == ["fresh", "link", "vectors"]  # no partial or old folder left


@pytest.mark.parametrize("bad", ["tab\there", "line\nbreak", "carriage\rreturn"])
def test_a_name_a_names_file_cannot_hold_is_refused_by_name(runs, tmp_path, monkeypatch, bad):
    from dsa_train.results.names import TableNames
    from dsa_train.results.text_blobs import encoded

    plain = TableNames.names
    renamed = lambda self, table, ids: [bad if i == 41 else n for i, n in zip(ids, plain(self, table, ids))]  # noqa: E731
    monkeypatch.setattr(TableNames, "names", renamed)
    monkeypatch.setattr(
        TableNames, "name_bytes", lambda self, table, start, stop: encoded(renamed(self, table, range(start, stop)))
    )
    with pytest.raises(DsaError, match="holds a tab or a line break") as refused:
        export_run(open_run(runs()), tmp_path / "out", "npy", chunk_rows=16)
    assert repr(bad) in str(refused.value) and os.listdir(tmp_path) == []


def test_a_failed_export_leaves_nothing_under_the_name(runs, tmp_path, monkeypatch):
    from dsa_train.results import export as export_module

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "_text_rows", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_run(open_run(runs()), tmp_path / "out", "tsv")
    assert os.listdir(tmp_path) == []


def test_a_predicted_rank_is_evals_filtered_rank(runs, tmp_path):
    """For every test triple, both sides: 1 + the answers not known in any split that predict
    puts above the true one equals the rank `eval --save-ranks` wrote."""
    run = runs("distmult")
    saved = tmp_path / "ranks.tsv"
    result = CliRunner().invoke(app, ["eval", str(run), "--save-ranks", str(saved)])
    assert result.exit_code == 0, result.output
    lines = [line.split("\t") for line in saved.read_text().splitlines()[1:]]
    trained = open_run(run)
    queries = [(int(h), int(r), None) if side == "tail" else (None, int(r), int(t)) for side, h, r, t, _ in lines]
    answers = trained.predict_many(queries, k=ENTITIES, filter="mark", chunk_rows=16)
    for (side, h, r, t, rank), ranked in zip(lines, answers):
        target = int(t) if side == "tail" else int(h)
        position = [a.id for a in ranked].index(target)
        assert 1 + sum(not a.known for a in ranked[:position]) == float(rank), (side, h, r, t)


def test_predict_and_neighbors_from_the_command_line(runs, tmp_path):
    run = runs()
    trained = open_run(run)
    head = entity_name(5)
    result = CliRunner().invoke(
        app, ["predict", str(run), "--head", head, "--relation", "r1", "-k", "3", "--filter", "--json"]
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    expected = trained.predict(head=head, relation="r1", k=3, filter=True)
    assert [a["name"] for a in document["queries"][0]["answers"]] == [a.name for a in expected]
    queries = tmp_path / "q.tsv"
    queries.write_text(f"{head}\tr1\t?\n?\tr2\t{entity_name(7)}\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["predict", str(run), "--queries", str(queries), "-k", "2"])
    assert result.exit_code == 0, result.output
    assert f"({head}, r1, ?)" in result.stdout and f"(?, r2, {entity_name(7)})" in result.stdout
    queries.write_text(f"{head}\tr1\t{head}\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["predict", str(run), "--queries", str(queries)])
    assert result.exit_code == 1 and "line 1 of" in result.stderr and "exactly one ?" in result.stderr
    result = CliRunner().invoke(app, ["predict", str(run), "--head", "Q14x", "--relation", "r1"])
    assert (
        result.exit_code == 1
        and "entity 'Q14x' is not in this run's entities" in result.stderr
        and "did you mean 'Q14'" in result.stderr
    )
    assert "Traceback" not in result.stderr
    result = CliRunner().invoke(app, ["neighbors", str(run), head, "-k", "4", "--metric", "cosine", "--json"])
    assert result.exit_code == 0, result.output
    assert [a["id"] for a in json.loads(result.stdout)["neighbors"]] == [
        a.id for a in trained.neighbors(head, k=4, metric="cosine")
    ]


@pytest.fixture(scope="module")
def grown(graph, tmp_path_factory):
    """The graph plus 20 new entities and a new relation, in new triples of every split."""
    folder = tmp_path_factory.mktemp("grown-kg")
    for split in ("train", "valid", "test"):
        lines = (graph[0] / f"{split}.txt").read_text(encoding="utf-8")
        if split == "train":
            lines += "".join(f"new/{i:03d}\tr{i % 5}\t{entity_name(i)}\n" for i in range(20))  # r4 is new
        (folder / f"{split}.txt").write_text(lines, encoding="utf-8")
    return folder


def setup_fresh(graph_folder, run_folder, storage, init_from=None):
    """A new run's Training, set up (step 0), with or without a warm start."""
    from dsa_train.recipe import load_recipe
    from dsa_train.results.warm_start import carry_over
    from dsa_train.train.loop import Training
    from dsa_train.runs.run_folder import RunFolder

    text = RECIPE % {"data": graph_folder, "model": "transe", "storage": storage}
    path = run_folder.parent / f"{run_folder.name}.yaml"
    path.write_text(text)
    recipe = load_recipe(path, [f"model.init_from={init_from}"] if init_from else [])
    training = Training(recipe, RunFolder.create(recipe, run_folder), warm_start=carry_over)
    training.setup(resume=False)
    return training


@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_warm_start_carries_rows_by_name_bit_for_bit(runs, grown, tmp_path, storage):
    old = open_run(runs("transe", storage))
    warm = setup_fresh(grown, tmp_path / "warm", storage, init_from=old.run.path)
    cold = setup_fresh(grown, tmp_path / "cold", storage)
    try:
        assert warm.warm_started == {
            "entities": {"carried": ENTITIES, "new": 20},
            "relations": {"carried": 2 * RELATIONS, "new": 2},
        }
        new = TrainedRunView(warm)
        drawn = TrainedRunView(cold)
        for table in ("entities", "relations"):
            names = new.names(table)
            rows = new.weights(table)
            for i, name in enumerate(names):
                found = old.lookup(table, [name])[0]
                expected = old.weights(table)[found] if found is not None else drawn.weights(table)[i]
                assert torch.equal(rows[i], expected), (table, name)
    finally:
        warm.close()
        cold.close()


class TrainedRunView:
    """Weights and names of a Training's task at step 0, through the reader's own helpers."""

    def __init__(self, training) -> None:
        from dsa_train.results.names import TableNames, task_tables

        self.tables = task_tables(training.task, training.recipe)
        self.names_of = TableNames(training.task, training.recipe, self.tables)

    def names(self, table):
        return self.names_of.names(table, range(self.names_of.rows[table]))

    def weights(self, table):
        module = self.tables[table]
        return module(torch.arange(self.names_of.rows[table])).detach().clone()


def test_init_from_on_the_command_line_says_what_it_carried(runs, grown, tmp_path):
    recipe = tmp_path / "grown.yaml"
    recipe.write_text(RECIPE % {"data": grown, "model": "transe", "storage": "memory"})
    result = CliRunner().invoke(app, ["run", str(recipe), "-o", str(tmp_path / "run"), "--init-from", str(runs())])
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())  # notes wrap at the console's width
    assert (
        f"entities {ENTITIES} carried over, 20 new; relations {2 * RELATIONS} carried over, 2 new; Adam's moments start at zero"
        in said
    )
    summary = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if '"summary"' in line
    ][-1]
    assert summary["warm_start"]["entities"] == {"carried": ENTITIES, "new": 20}
    result = CliRunner().invoke(
        app, ["run", str(recipe), "-o", str(tmp_path / "other"), "--init-from", str(tmp_path / "nowhere")]
    )
    assert result.exit_code == 1 and "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_a_warm_started_disk_run_resumes_exactly(runs, grown, tmp_path):
    """Its rows were written before the first step, so its first checkpoint holds whole tables,
    not deltas on the table as drawn: a run stopped by an error after it resumes to the uninterrupted run's bytes."""
    from .helpers import error_at_step

    recipe = tmp_path / "grown.yaml"
    recipe.write_text(RECIPE % {"data": grown, "model": "transe", "storage": "disk"})
    source = str(runs("transe", "disk"))
    small = [
        "--set",
        "train.batch_size=2",
        "--set",
        "train.negatives=1",
        "--set",
        "train.max_steps=8",
    ]  # few rows touched by step 3
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert CliRunner().invoke(app, ["run", str(recipe), "-o", str(whole), "--init-from", source, *small]).exit_code == 0
    with error_at_step(5):  # after the checkpoint of step 3
        crashed = CliRunner().invoke(app, ["run", str(recipe), "-o", str(broken), "--init-from", source, *small])
        assert crashed.exit_code == 1 and "injected error at step" in crashed.stderr
    resumed = CliRunner().invoke(app, ["run", str(recipe), "-o", str(broken), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    for rows in ("tables/entities.table", "optimizer_state/rel_emb.weight.rows"):
        x = np.fromfile(whole / rows, dtype=np.float32, offset=4096)  # past the header, which names the run
        y = np.fromfile(broken / rows, dtype=np.float32, offset=4096)
        assert np.array_equal(x, y), rows


def test_parquet_export_round_trips(runs, tmp_path):
    import pyarrow.parquet as pq  # the test extra installs it: its absence fails, never skips

    trained = open_run(runs("rotate", "disk"))
    manifest = export_run(trained, tmp_path / "pq", "parquet", chunk_rows=7)
    assert manifest["tables"]["relations"]["meaning"].startswith("phases in radians")
    for table in ("entities", "relations"):
        read = pq.read_table(tmp_path / "pq" / f"{table}.parquet")
        assert read.column("id").to_pylist() == list(range(trained.tables[table][0]))
        assert read.column("name").to_pylist() == trained.names(table)
        vectors = np.array(read.column("vector").to_pylist(), dtype=np.float32)
        assert np.array_equal(vectors, trained.weights(table).numpy())


CLICKS = """\
name: clicks
dataset: {kind: click_log, path: %(path)s, columns: {holdout: [0.1, 0.1]}}
model: {kind: dlrm, dim: 4, init_std: 0.1, recsys: {rows: 64, bottom: [8], top: [8]}}
train: {epochs: 1, batch_size: 64, checkpoint_every: 0, log_every: 100}
optimizer: {kind: dsa, lr: 0.01, dense_lr: 0.01}
eval: {every_epochs: 0, final_splits: []}
"""


def test_click_probabilities_are_the_models_on_the_held_out_lines(tmp_path):
    """The test split's last lines, written again without their labels, get the probabilities
    the run's own evaluation path computes for them from the imported arrays."""
    g = np.random.default_rng(0)
    rows = [
        f"{int(g.random() < 0.3)}\t{g.integers(0, 50)}\tc{g.integers(0, 30)}\t{'|'.join(f'v{g.integers(0, 9)}' for _ in range(g.integers(0, 3)))}"
        for _ in range(400)
    ]
    log = tmp_path / "log.tsv"
    log.write_text("label\tI1\tC1\tC2\n" + "".join(r + "\n" for r in rows))
    recipe = tmp_path / "clicks.yaml"
    recipe.write_text(CLICKS % {"path": log})
    assert CliRunner().invoke(app, ["run", str(recipe), "-o", str(tmp_path / "run")]).exit_code == 0
    trained = open_run(tmp_path / "run")
    assert trained.tables == {"features": (128, 4)}  # two features' tables of 64 rows
    unlabeled = tmp_path / "today.tsv"
    unlabeled.write_text("I1\tC1\tC2\n" + "".join(r.split("\t", 1)[1] + "\n" for r in rows[-40:]))
    ours = torch.cat(list(trained.click_probabilities(unlabeled)))
    with torch.no_grad():
        theirs = torch.sigmoid(trained.task.logits("test", torch.arange(40))[0])
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6)
    out = tmp_path / "p.txt"
    result = CliRunner().invoke(app, ["predict", str(tmp_path / "run"), "--clicks", str(unlabeled), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert np.allclose(np.loadtxt(out), ours.numpy(), rtol=0, atol=1e-7)
    result = CliRunner().invoke(app, ["predict", str(tmp_path / "run"), "--clicks", str(unlabeled), "-o", str(out)])
    assert result.exit_code == 1 and "already exists" in result.stderr
    other = tmp_path / "other.tsv"
    other.write_text("I1\tC1\n1\ta\n")
    result = CliRunner().invoke(app, ["predict", str(tmp_path / "run"), "--clicks", str(other)])
    assert result.exit_code == 1 and "the run trained on ['C1', 'C2']" in result.stderr


def test_an_old_or_linked_run_folder_is_refused_by_name(runs, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(runs(), old)
    (old / "run.json").unlink()  # as dsa-train 0.1 left it
    result = CliRunner().invoke(app, ["export", str(old), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "run.json" in result.stderr and "Traceback" not in result.stderr
    linked = tmp_path / "linked"
    shutil.copytree(runs(), linked)
    shutil.move(linked / "checkpoints", tmp_path / "elsewhere")
    (linked / "checkpoints").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DsaError, match="is a symbolic link"):
        open_run(linked)
    assert not (tmp_path / "out").exists()


def test_a_generated_graphs_rows_are_named_by_their_ids(tmp_path):
    recipe = tmp_path / "synthetic.yaml"
    recipe.write_text(
        RECIPE.replace(
            "{kind: tsv, path: %(data)s}",
            "{kind: synthetic, synthetic: {entities: 120, relations: 3, triples: 900, valid: 20, test: 20, seed: 2}}",
        )
        % {"model": "distmult", "storage": "memory"}
    )
    assert CliRunner().invoke(app, ["run", str(recipe), "-o", str(tmp_path / "run")]).exit_code == 0
    trained = open_run(tmp_path / "run")
    assert trained.names("entities", [0, 119]) == ["0", "119"] and trained.names("relations", [4]) == ["inverse:1"]
    assert trained.ids("relations", ["2", "inverse:0"]) == [2, 3]
    assert [a.id for a in trained.predict(head="7", relation="1", k=4)] == [
        a.id for a in trained.predict(head=7, relation=1, k=4)
    ]
    with pytest.raises(DsaError, match="entity '120' is not in this run's entities"):
        trained.ids("entities", ["120"])
