"""Datasets by name (``dataset.fetch``, and FB15k-237 / WN18RR): downloaded on first use from a
local HTTP server (``$DSA_DOWNLOAD_MIRROR``), checked, imported; a file already there is
checked, never replaced; offline names every missing file, its address and its path."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import socket
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.data import load_knowledge_graph, remote
from dsa_train.data.downloads import MIRROR_ENV, Expected
from dsa_train.data.paths import import_target
from dsa_train.errors import DatasetError
from dsa_train.recipe import DatasetConfig, parse_recipe


SPLITS = {
    "train.txt": b"a\tr\tb\nb\tr\tc\nc\ts\ta\n",
    "valid.txt": b"a\ts\tc\n",
    "test.txt": b"b\ts\tc\n",
}
BASE = "https://raw.githubusercontent.com/pykeen/pykeen/master/src/pykeen/datasets/umls"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tiny_umls(digests: bool = True) -> remote.RemoteDataset:
    """The registry's UMLS entry with tiny files (their digests, or none known)."""
    files = tuple(
        remote.RemoteFile(name, f"{BASE}/{name}", Expected(sha256=sha(body), size=len(body)) if digests else Expected())
        for name, body in SPLITS.items()
    )
    return dataclasses.replace(remote.DATASETS["umls"], files=files)


@pytest.fixture
def umls(server, monkeypatch):
    """UMLS by name, served as three tiny files; the data root."""
    monkeypatch.setitem(remote.DATASETS, "umls", tiny_umls())
    for name, body in SPLITS.items():
        server.serve(f"{BASE}/{name}", body)
    return Path(os.environ["DSA_DATA_ROOT"])


def refused() -> str:
    """An address where nobody listens (a connection there is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_recipe_by_name_downloads_imports_and_loads(umls, server):
    recipe = parse_recipe("dataset: {kind: tsv, fetch: umls}\nmodel: {kind: transe}\n", source="r")
    kg = load_knowledge_graph(recipe.dataset)
    assert (kg.num_entities, kg.num_relations, len(kg.train), len(kg.valid), len(kg.test)) == (3, 2, 3, 1, 1)
    assert sorted(kg.entity_names(range(3))) == ["a", "b", "c"]
    for name, body in SPLITS.items():
        assert (umls / "umls" / name).read_bytes() == body
    record = json.loads((umls / "umls" / "digests.json").read_text())["files"]
    assert {k: v["sha256"] for k, v in record.items()} == {k: sha(v) for k, v in SPLITS.items()}
    asked = len(server.requests)
    assert asked == 3
    again = load_knowledge_graph(recipe.dataset)  # in place and checked: nothing is asked again
    assert len(server.requests) == asked and again.num_entities == 3
    # the same import folder as the recipe's old form (dataset.path: umls under the data root)
    by_path = DatasetConfig(kind="tsv", path="umls")
    assert import_target(by_path, "tsv-umls", str((umls / "umls").resolve())) == import_target(
        recipe.dataset, "tsv-umls", str((umls / "umls").resolve())
    )
    assert [p.name for p in (umls / "imported").iterdir() if not p.name.startswith(".")] == [
        import_target(by_path, "tsv-umls", str((umls / "umls").resolve())).name
    ]


def test_offline_names_every_missing_file_its_address_and_path(umls, monkeypatch):
    (umls / "umls").mkdir()
    (umls / "umls" / "train.txt").write_bytes(SPLITS["train.txt"])  # one is there already
    monkeypatch.setenv(MIRROR_ENV, refused())
    with pytest.raises(DatasetError) as caught:
        load_knowledge_graph(DatasetConfig(kind="tsv", fetch="umls"))
    message, hint = caught.value.message, caught.value.hint
    for name in ("valid.txt", "test.txt"):
        assert f"{umls / 'umls' / name}  <-  {os.environ[MIRROR_ENV]}/raw.githubusercontent.com/" in message
        assert f"/src/pykeen/datasets/umls/{name}" in message
    assert "train.txt" not in message and "could not be reached" in message
    assert "by hand" in hint and "checked against their digests" in hint


def test_a_file_in_place_with_another_digest_is_an_error_and_kept(umls):
    (umls / "umls").mkdir()
    (umls / "umls" / "valid.txt").write_bytes(b"x\ty\tz\n")
    with pytest.raises(DatasetError, match=r"umls/valid.txt' is not umls's valid.txt: .*sha256 ") as caught:
        load_knowledge_graph(DatasetConfig(kind="tsv", fetch="umls"))
    assert sha(SPLITS["valid.txt"]) in caught.value.message and "move" in caught.value.hint
    assert (umls / "umls" / "valid.txt").read_bytes() == b"x\ty\tz\n"


def test_a_link_in_place_of_a_file_is_refused(umls, tmp_path):
    (umls / "umls").mkdir()
    theirs = tmp_path / "theirs.txt"
    theirs.write_bytes(SPLITS["test.txt"])
    os.symlink(theirs, umls / "umls" / "test.txt")
    with pytest.raises(DatasetError, match="test.txt' is a symbolic link"):
        load_knowledge_graph(DatasetConfig(kind="tsv", fetch="umls"))
    assert theirs.read_bytes() == SPLITS["test.txt"]


def test_without_a_known_digest_the_first_download_is_pinned(umls, server, monkeypatch, notes):
    monkeypatch.setitem(remote.DATASETS, "umls", tiny_umls(digests=False))
    folder = remote.fetch("umls", umls)
    assert any("no digest of 'train.txt' is known" in n for n in notes)
    assert json.loads((folder / "digests.json").read_text())["files"]["train.txt"]["sha256"] == sha(SPLITS["train.txt"])
    (folder / "train.txt").unlink()
    server.serve(f"{BASE}/train.txt", b"a\tr\tz\n")  # the file at the address changed
    with pytest.raises(DatasetError, match=f"expected {sha(SPLITS['train.txt'])}"):
        remote.fetch("umls", umls)
    assert not (folder / "train.txt").exists()


def test_an_archive_is_downloaded_and_its_files_taken_out(server, monkeypatch, tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, body in [("./kg_train.txt", SPLITS["train.txt"]), ("kg_valid.txt", SPLITS["valid.txt"])]:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        evil = tarfile.TarInfo("../../escape.txt")
        evil.size = 1
        tar.addfile(evil, io.BytesIO(b"!"))
    url = "https://example.org/kg.tar.gz"
    server.serve(url, buffer.getvalue())
    entry = remote.RemoteDataset(
        "kg",
        "kg",
        (remote.RemoteFile("kg.tar.gz", url),),
        (
            remote.Member("train.txt", "kg.tar.gz", "kg_train.txt"),
            remote.Member("valid.txt", "kg.tar.gz", "kg_valid.txt"),
        ),
    )
    monkeypatch.setitem(remote.DATASETS, "kg", entry)
    folder = remote.fetch("kg", tmp_path)
    assert (folder / "train.txt").read_bytes() == SPLITS["train.txt"]
    assert (folder / "valid.txt").read_bytes() == SPLITS["valid.txt"]
    assert not (tmp_path.parent / "escape.txt").exists() and not (tmp_path / "escape.txt").exists()
    record = json.loads((folder / "digests.json").read_text())["files"]
    assert record["train.txt"]["how"] == "taken out of kg.tar.gz" and set(record) == {
        "kg.tar.gz",
        "train.txt",
        "valid.txt",
    }
    (folder / "kg.tar.gz").unlink()  # the archive may go once its files are out
    (folder / "valid.txt").write_bytes(b"changed\tby\thand\n")
    with pytest.raises(DatasetError, match="valid.txt' is not kg's valid.txt"):
        remote.fetch("kg", tmp_path)


def test_pyg_datasets_are_fetched_and_checked_too(server, monkeypatch):
    folder = Path(os.environ["DSA_DATA_ROOT"]) / "FB15k-237" / "raw"
    folder.mkdir(parents=True)
    (folder / "train.txt").write_bytes(b"a\tr\tb\n")
    with pytest.raises(DatasetError, match=r"FB15k-237/raw/train.txt' is not fb15k237's raw/train.txt"):
        load_knowledge_graph(DatasetConfig(kind="fb15k237"))


def test_the_recipe_names_are_the_registry_names():
    from typing import get_args, get_type_hints

    from dsa_train.data import pyg

    names = {a for t in get_args(get_type_hints(DatasetConfig)["fetch"]) for a in get_args(t)}
    assert names == set(remote.DATASETS) - set(pyg.DATASETS)  # every one but PyG's, which their kinds fetch


def test_the_cli_reports_offline_in_words_and_fails(umls, monkeypatch, tmp_path):
    monkeypatch.setenv(MIRROR_ENV, refused())
    recipe = tmp_path / "r.yaml"
    recipe.write_text("dataset: {kind: tsv, fetch: umls}\nmodel: {kind: transe}\n")
    result = CliRunner().invoke(app, ["import", str(recipe)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "Error: dataset 'umls' could not be downloaded" in result.output


def test_the_real_files_of_umls_and_nations_match_the_registry(test_data, server):
    """The registry's digests and sizes are the shipped files' (served from the test data):
    fetched by name, UMLS and Nations import into the same triples and names as read from
    the folders themselves."""
    for name in ("umls", "nations"):
        for remote_file in remote.DATASETS[name].files:
            server.serve(remote_file.url, (test_data / name / remote_file.name).read_bytes())
        fetched = load_knowledge_graph(DatasetConfig(kind="tsv", fetch=name))
        direct = load_knowledge_graph(DatasetConfig(kind="tsv", path=str(test_data / name)))
        for split in ("train", "valid", "test"):
            assert (getattr(fetched, split) == getattr(direct, split)).all(), (name, split)
        ids = range(direct.num_entities)
        assert fetched.entity_names(ids) == direct.entity_names(ids)


def test_yago3_10_by_name_checks_the_archive_by_its_git_blob_id_and_imports_its_files(server, monkeypatch):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, body in SPLITS.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    archive = buffer.getvalue()
    real = remote.DATASETS["yago3-10"]
    server.serve(real.files[0].url, archive)
    blob = hashlib.sha1(f"blob {len(archive)}\0".encode() + archive).hexdigest()
    fixture = dataclasses.replace(real.files[0], expected=Expected(git_blob=blob))
    monkeypatch.setitem(remote.DATASETS, "yago3-10", dataclasses.replace(real, files=(fixture,)))
    kg = load_knowledge_graph(DatasetConfig(kind="tsv", fetch="yago3-10"))
    assert (kg.num_entities, kg.num_relations, len(kg.train), len(kg.valid), len(kg.test)) == (3, 2, 3, 1, 1)
    record = json.loads((Path(os.environ["DSA_DATA_ROOT"]) / "yago3-10" / "digests.json").read_text())["files"]
    assert record["YAGO3-10.tar.gz"]["sha256"] == sha(archive) and record["test.txt"]["sha256"] == sha(
        SPLITS["test.txt"]
    )


def test_a_path_set_over_a_recipe_by_name_is_read_instead(umls, server, tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    for name, body in SPLITS.items():
        (own / name).write_bytes(body.replace(b"a", b"x"))
    recipe = parse_recipe("dataset: {kind: tsv, fetch: umls}\nmodel: {kind: transe}\n", source="r")
    kg = load_knowledge_graph(dataclasses.replace(recipe.dataset, path=str(own)))  # as --set dataset.path= does
    assert sorted(kg.entity_names(range(3))) == ["b", "c", "x"] and not server.requests
    switched = dataclasses.replace(recipe.dataset, kind="synthetic")  # --set dataset.kind=synthetic: fetch unread
    assert not switched.problems()


def test_a_folder_that_cannot_be_written_is_used_without_a_record(umls, server, monkeypatch):
    folder = umls / "umls"
    folder.mkdir()
    for name, body in SPLITS.items():
        (folder / name).write_bytes(body)

    def read_only(path, *data):  # as on a read-only copy of the files (root writes through chmod 555)
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(remote, "atomic_write_bytes", read_only)
    assert load_knowledge_graph(DatasetConfig(kind="tsv", fetch="umls")).num_entities == 3
    assert not (folder / "digests.json").exists() and not server.requests
