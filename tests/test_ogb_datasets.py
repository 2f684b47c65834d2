"""OGB's ogbl-wikikg2 and ogbl-biokg by name: the zip fetched from a local HTTP server (in
OGB's layout: same file names, dict keys and dtypes, tiny), imported with global ids and fixed
negatives, evaluated with OGB's protocol and cross-checked by a computation written here from
OGB's example code; the split reader refuses a pickle that asks for anything but NumPy arrays."""

from __future__ import annotations

import gzip
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_train.data import load_knowledge_graph
from dsa_train.data.downloads import MIRROR_ENV
from dsa_train.data.ogb_split import load_split
from dsa_train.errors import DatasetError
from dsa_train.recipe import DatasetConfig, parse_recipe


URL = "http://snap.stanford.edu/ogb/data/linkproppred"
BIOKG_TYPES = {"protein": 12, "drug": 8, "disease": 5, "function": 10, "sideeffect": 6}  # OGB's CSV order is not sorted


def saved(obj: dict, *, numpy1: bool = False) -> bytes:
    """``torch.save``'s bytes; ``numpy1``: the older single-stream container, with NumPy 1's
    module name in the pickle (as files written before NumPy 2 have it)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=not numpy1)
    data = buffer.getvalue()
    return data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray") if numpy1 else data


def gz(text: str) -> bytes:
    return gzip.compress(text.encode())


def zipped(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
    return buffer.getvalue()


def wikikg2_splits(rng) -> dict[str, dict]:
    n, r, k = 40, 5, 30
    out = {}
    for split, m in (("train", 200), ("valid", 15), ("test", 17)):
        d = {"head": rng.integers(0, n, m), "relation": rng.integers(0, r, m), "tail": rng.integers(0, n, m)}
        if split != "train":
            d["head_neg"], d["tail_neg"] = rng.integers(0, n, (m, k)), rng.integers(0, n, (m, k))
        out[split] = d
    return out


def wikikg2_zip(splits: dict[str, dict]) -> bytes:
    train = splits["train"]
    top = "wikikg-v2"
    return zipped(
        {
            f"{top}/RELEASE_v1.txt": b"",
            f"{top}/raw/num-node-list.csv.gz": gz("40\n"),
            f"{top}/raw/num-edge-list.csv.gz": gz(f"{len(train['head'])}\n"),
            f"{top}/raw/edge.csv.gz": gz("".join(f"{h},{t}\n" for h, t in zip(train["head"], train["tail"]))),
            f"{top}/raw/edge_reltype.csv.gz": gz("".join(f"{r}\n" for r in train["relation"])),
            f"{top}/split/time/train.pt": saved(train),
            f"{top}/split/time/valid.pt": saved(splits["valid"], numpy1=True),
            f"{top}/split/time/test.pt": saved(splits["test"]),
        }
    )


def biokg_splits(rng) -> dict[str, dict]:
    names = list(BIOKG_TYPES)
    out = {}
    for split, m in (("train", 150), ("valid", 11), ("test", 13)):
        head_type = np.array([names[i] for i in rng.integers(0, len(names), m)])
        tail_type = np.array([names[i] for i in rng.integers(0, len(names), m)])
        local = lambda types: np.array([rng.integers(0, BIOKG_TYPES[t]) for t in types])  # noqa: E731
        d = {
            "head_type": head_type,
            "tail_type": tail_type,
            "head": local(head_type),
            "relation": rng.integers(0, 7, m),
            "tail": local(tail_type),
        }
        if split != "train":
            d["head_neg"] = np.stack([local([t] * 9) for t in head_type])
            d["tail_neg"] = np.stack([local([t] * 9) for t in tail_type])
        out[split] = d
    out["valid"]["head_type"] = list(out["valid"]["head_type"])  # a list of NumPy str scalars
    out["train"]["tail_type"] = [str(t) for t in out["train"]["tail_type"]]  # a list of str
    out["test"]["tail_type"] = out["test"]["tail_type"].astype(object)  # or an object array
    return out


def biokg_zip(splits: dict[str, dict]) -> bytes:
    return zipped(
        {
            "biokg/raw/num-node-dict.csv.gz": gz(
                ",".join(BIOKG_TYPES) + "\n" + ",".join(map(str, BIOKG_TYPES.values())) + "\n"
            ),
            "biokg/raw/triplet-type-list.csv.gz": gz("drug,drug-protein,protein\n"),
            **{f"biokg/split/random/{s}.pt": saved(d, numpy1=s == "test") for s, d in splits.items()},
        }
    )


def ogb_mrr_by_hand(model, splits: dict, split: str, offset_of) -> float:
    """OGB's example code's test step, written out: for head-batch then tail-batch, candidates
    ``[answer] + negatives`` (global ids: local + the type's offset), the Evaluator's rank
    ``0.5 * (#> + #>=) + 1``, the mean of 1 / rank over both lists. Triples are scored by the
    model's forward (h, r, t); a reciprocal model scores a head query as (t, r + R, h)."""

    def score(h, r, t):
        if model.reciprocal and side == "head":
            return model(t, r + model.num_base_relations, h)
        return model(h, r, t)

    d = splits[split]
    reciprocal = []
    for side, other in (("head", "tail"), ("tail", "head")):
        for i in range(len(d["head"])):
            answer = int(d[side][i]) + offset_of(d[f"{side}_type"][i] if f"{side}_type" in d else "")
            anchor = int(d[other][i]) + offset_of(d[f"{other}_type"][i] if f"{other}_type" in d else "")
            negs = [
                int(x) + offset_of(d[f"{side}_type"][i] if f"{side}_type" in d else "") for x in d[f"{side}_neg"][i]
            ]
            cands = torch.tensor([answer, *negs])
            anchors = torch.full_like(cands, anchor)
            rel = torch.full_like(cands, int(d["relation"][i]))
            s = score(cands, rel, anchors) if side == "head" else score(anchors, rel, cands)
            pos, neg = s[0], s[1:]
            reciprocal.append(1.0 / float(0.5 * ((neg > pos).sum() + (neg >= pos).sum()) + 1))
    return float(np.mean(reciprocal))


RECIPE = """
dataset: {{kind: ogbl, fetch: {name}}}
model: {{kind: {model}, dim: 8, reciprocal: {reciprocal}}}
train: {{epochs: 1, batch_size: 64, negatives: 8, seed: 3}}
eval: {{protocol: both, final_splits: [test]}}
"""


@pytest.mark.parametrize(("model", "reciprocal"), [("transe", True), ("complex", False)])
def test_wikikg2_by_name_imports_and_evaluates_as_ogb_does(server, model, reciprocal):
    from dsa_train.train.kge import KGETask

    splits = wikikg2_splits(np.random.default_rng(1))
    server.serve(f"{URL}/wikikg-v2.zip", wikikg2_zip(splits))
    recipe = parse_recipe(RECIPE.format(name="ogbl-wikikg2", model=model, reciprocal=reciprocal), source="r")
    torch.manual_seed(0)
    task = KGETask(recipe, torch.device("cpu"))
    kg = task.kg
    assert (kg.num_entities, kg.num_relations, len(kg.train), len(kg.valid), len(kg.test)) == (40, 5, 200, 15, 17)
    for split in ("train", "test"):
        expected = np.stack([splits[split][k] for k in ("head", "relation", "tail")], axis=1)
        assert (kg.split(split).numpy() == expected).all()
    head_neg, tail_neg = kg.fixed_negatives("valid")
    assert (head_neg == splits["valid"]["head_neg"]).all() and (tail_neg == splits["valid"]["tail_neg"]).all()
    task.model.eval()
    metrics = task.evaluate("test", final=True)
    assert {"tail", "head", "both", "ogb"} <= set(metrics) and metrics["ogb"]["queries"] == 34
    expected = ogb_mrr_by_hand(task.model, splits, "test", lambda t: 0)
    assert metrics["ogb"]["mrr"] == pytest.approx(expected, abs=1e-6)
    assert "OGB MRR" in task.headline(metrics)
    record = json.loads((Path(os.environ["DSA_DATA_ROOT"]) / "ogbl-wikikg2" / "digests.json").read_text())["files"]
    assert record["wikikg-v2.zip"]["how"].endswith("(first download)")  # no digest is known: trusted on first use


def test_biokg_ids_are_global_by_sorted_type_and_negatives_are_of_the_answers_type(server):
    from dsa_train.train.kge import KGETask

    splits = biokg_splits(np.random.default_rng(2))
    server.serve(f"{URL}/biokg.zip", biokg_zip(splits))
    recipe = parse_recipe(RECIPE.format(name="ogbl-biokg", model="distmult", reciprocal=True), source="r")
    torch.manual_seed(0)
    task = KGETask(recipe, torch.device("cpu"))
    kg = task.kg
    offsets, at = {}, 0
    for t in sorted(BIOKG_TYPES):  # OGB's entity_dict: types in sorted order, one after another
        offsets[t], at = at, at + BIOKG_TYPES[t]
    assert kg.num_entities == sum(BIOKG_TYPES.values())
    test = splits["test"]
    heads = [int(h) + offsets[t] for h, t in zip(test["head"], test["head_type"])]
    assert kg.split("test")[:, 0].tolist() == heads
    head_neg, tail_neg = kg.fixed_negatives("test")
    for i, t in enumerate(test["tail_type"]):
        assert (tail_neg[i] >= offsets[t]).all() and (tail_neg[i] < offsets[t] + BIOKG_TYPES[t]).all()
    assert kg.dataset.meta["ogb"]["entity_types"]["drug"] == {"offset": offsets["drug"], "count": 8}
    task.model.eval()
    metrics = task.evaluate("test", final=True)
    expected = ogb_mrr_by_hand(task.model, splits, "test", lambda t: offsets[t])
    assert metrics["ogb"]["mrr"] == pytest.approx(expected, abs=1e-6) and metrics["ogb"]["queries"] == 26


def test_offline_names_the_zip_its_address_and_where_to_place_it(monkeypatch):
    monkeypatch.setenv(MIRROR_ENV, "http://127.0.0.1:9")  # nobody listens on port 9 (discard)
    with pytest.raises(DatasetError) as caught:
        load_knowledge_graph(DatasetConfig(kind="ogbl", fetch="ogbl-wikikg2"))
    root = Path(os.environ["DSA_DATA_ROOT"])
    assert f"{root / 'ogbl-wikikg2' / 'wikikg-v2.zip'}  <-  " in caught.value.message
    assert "/snap.stanford.edu/ogb/data/linkproppred/wikikg-v2.zip" in caught.value.message
    assert "by hand" in caught.value.hint


def test_an_interrupted_download_of_the_zip_is_resumed(server):
    splits = wikikg2_splits(np.random.default_rng(4))
    body = wikikg2_zip(splits)
    server.serve(f"{URL}/wikikg-v2.zip", body)
    server.cut_after = len(body) // 2
    with pytest.raises(DatasetError, match="could not be downloaded"):
        load_knowledge_graph(DatasetConfig(kind="ogbl", fetch="ogbl-wikikg2"))
    kg = load_knowledge_graph(DatasetConfig(kind="ogbl", fetch="ogbl-wikikg2"))
    assert len(kg.test) == 17 and server.requests[-1][1] == f"bytes={len(body) // 2}-"


def test_a_changed_file_is_refused_once_the_first_download_is_recorded(server):
    server.serve(f"{URL}/wikikg-v2.zip", wikikg2_zip(wikikg2_splits(np.random.default_rng(5))))
    load_knowledge_graph(DatasetConfig(kind="ogbl", fetch="ogbl-wikikg2"))
    folder = Path(os.environ["DSA_DATA_ROOT"]) / "ogbl-wikikg2"
    (folder / "test.pt").write_bytes(saved(wikikg2_splits(np.random.default_rng(6))["test"]))
    with pytest.raises(DatasetError, match=r"test.pt' is not ogbl-wikikg2's test.pt: .*recorded in"):
        load_knowledge_graph(DatasetConfig(kind="ogbl", fetch="ogbl-wikikg2"))


def test_the_split_reader_refuses_a_pickle_that_asks_for_os_system(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo unpickled > " + str(tmp_path / "ran"),))

    for numpy1 in (False, True):
        path = tmp_path / f"train-{numpy1}.pt"
        path.write_bytes(saved({"head": Payload(), "relation": np.zeros(1), "tail": np.zeros(1)}, numpy1=numpy1))
        with pytest.raises(DatasetError, match=r"asks for more than NumPy arrays \(.*system"):
            load_split(path, split="train", typed=False)
    assert not (tmp_path / "ran").exists()


def test_the_split_reader_checks_keys_and_dtypes(tmp_path):
    path = tmp_path / "valid.pt"
    path.write_bytes(saved({"head": np.zeros(3, np.int64), "relation": np.zeros(3, np.int64), "tail": np.zeros(3)}))
    with pytest.raises(DatasetError, match="not OGB's valid split: no head_neg, tail_neg"):
        load_split(path, split="valid", typed=False)
    with pytest.raises(DatasetError, match="tail is float64, not an array of integer ids"):
        load_split(path, split="train", typed=False)
    path.write_bytes(saved({"head": torch.arange(3), "relation": np.zeros(3, np.int32), "tail": np.ones(3, np.int64)}))
    assert load_split(path, split="train", typed=False)["head"].tolist() == [0, 1, 2]  # tensors read as arrays


def test_an_id_outside_its_type_is_an_error_naming_the_file_and_row(server):
    splits = biokg_splits(np.random.default_rng(7))
    t = splits["valid"]["tail_type"][3]
    splits["valid"]["tail_neg"][3, 2] = BIOKG_TYPES[t]  # one past the type's last entity
    server.serve(f"{URL}/biokg.zip", biokg_zip(splits))
    with pytest.raises(
        DatasetError, match=rf"valid.pt': tail_neg\[3, 2\] is {BIOKG_TYPES[t]}, outside the .* of type '{t}'"
    ):
        load_knowledge_graph(DatasetConfig(kind="ogbl", fetch="ogbl-biokg"))


def test_the_ogb_protocol_needs_an_ogb_dataset():
    with pytest.raises(Exception, match="eval.protocol.*only dataset.kind: ogbl has"):
        parse_recipe("dataset: {kind: tsv, path: x}\nmodel: {kind: transe}\neval: {protocol: ogb}\n", source="r")
    with pytest.raises(Exception, match="set dataset.kind: ogbl"):
        parse_recipe("dataset: {kind: tsv, fetch: ogbl-biokg}\nmodel: {kind: transe}\n", source="r")


def test_a_run_reports_the_ogb_group_beside_the_filtered_one(server, tmp_path):
    """``dsa-train run`` end to end on the fixture zip: a disk table, an evaluation during
    training on a seeded sample of valid (max_queries), the final ones in full."""
    from typer.testing import CliRunner

    from dsa_train.cli.app import app
    from dsa_train.runs.run_folder import MetricsLog

    server.serve(f"{URL}/wikikg-v2.zip", wikikg2_zip(wikikg2_splits(np.random.default_rng(8))))
    recipe, out = tmp_path / "ogb.yaml", tmp_path / "run"
    recipe.write_text(
        "dataset: {kind: ogbl, fetch: ogbl-wikikg2}\n"
        "model: {kind: rotate, dim: 8, gamma: 5.0, reciprocal: false, embedding_storage: disk}\n"
        "train: {epochs: 2, batch_size: 64, negatives: 8, batch_negatives: false, loss: softplus}\n"
        "eval: {protocol: both, every_epochs: 1, max_queries: 10, final_splits: [valid, test]}\n"
    )
    result = CliRunner().invoke(app, ["run", str(recipe), "--output", str(out)])
    assert result.exit_code == 0, result.output
    records = MetricsLog.read(out / "metrics.jsonl")
    final = [r for r in records if r["kind"] == "summary"][0]["final"]
    assert final["test"]["ogb"]["queries"] == 34 and final["valid"]["ogb"]["queries"] == 30
    assert final["test"]["both"]["queries"] == 34
    during = [r for r in records if r["kind"] == "eval" and r["step"] == 4]  # epoch 1: 10 of valid's 15 triples
    assert len(during) == 1 and during[0]["ogb"]["queries"] == during[0]["both"]["queries"] == 20
    assert "OGB MRR" in result.output


def test_a_dry_run_sizes_wikikg2s_table_before_any_download():
    from dsa_train.recipe import load_recipe
    from dsa_train.train.estimate import estimate

    root = Path(__file__).resolve().parent.parent / "recipes"
    forecast = estimate(load_recipe(root / "ogbl-wikikg2-complex.yaml"))
    assert forecast.rows == 2_500_604 + 535  # entities and (not reciprocal) relations
    assert forecast.ram == 0 and dict((w, b) for w, b, _ in forecast.parts if "table file" in w)
    reciprocal = estimate(load_recipe(root / "ogbl-biokg-complex.yaml", ["model.reciprocal=true"]))
    assert reciprocal.rows == 93_773 + 2 * 51
