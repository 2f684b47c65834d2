"""``inspect-state`` and ``clean`` on a torchrun job's run folder (issue 14).

The layout is :mod:`dsa_train.train.sharded_run`'s::

    runs/a/  run.json, config.yaml, checkpoints.json, ranks/<rank>-of-<world>/ (a run folder each)

Most tests build it without torchrun: each rank folder is a tiny single-process run trained
into ``ranks/0000R-of-00002`` (rank 0 with 160 entities, rank 1 with 140, so the two are told
apart by their row counts), and the job's files are written by hand. Both ranks hold
checkpoints of steps 9, 12, 15 and 18; ``checkpoints.json`` lists 12 and 15 as complete, so
18 is the checkpoint of a step not every rank finished (the job was stopped while taking it).
One test runs a real two-rank job (``dsa-train run --nproc 2``), cleans it and resumes it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsa_train.cli.app import app
from dsa_train.errors import DsaError
from dsa_train.fsutil import DirectoryLock
from dsa_train.storage.format import HEADER_BYTES, RowSpec
from dsa_train.runs.cleanup import plan_clean, remove
from dsa_train.runs.run_folder import RUN_FORMAT

RECIPE = """\
name: tiny
dataset:
  kind: synthetic
  synthetic: {entities: %(entities)d, relations: 5, triples: 3000, valid: 50, test: 50, clusters: 6, seed: 1}
model: {kind: transe, dim: 8, init_std: 0.1}
train: {epochs: 5, max_steps: 18, batch_size: 256, negatives: 32, checkpoint_every: 3, keep_checkpoints: 4, log_every: 1, device: cpu}
optimizer: {kind: dsa, lr: 0.05}
eval: {final_splits: []}
"""
ENTITIES = {0: 160, 1: 140}
RANK0, RANK1 = "ranks/00000-of-00002", "ranks/00001-of-00002"


def invoke(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def step_name(step: int) -> str:
    return f"{step:010d}"


def write_manifest(job: Path, complete: list[int], world_size: int = 2) -> None:
    record = {"format": "dsa-train/sharded-checkpoints", "world_size": world_size, "complete": complete}
    (job / "checkpoints.json").write_text(json.dumps(record, indent=2))


def steps_of(rank: Path) -> list[int]:
    return sorted(int(p.name) for p in (rank / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def made_job(tmp_path_factory):
    """A stopped two-rank job's folder, made once (copied by ``job``)."""
    root = tmp_path_factory.mktemp("made")
    job = root / "runs" / "a"
    for rank, entities in ENTITIES.items():
        recipe = root / f"rank{rank}.yaml"
        recipe.write_text(RECIPE % {"entities": entities})
        result = invoke("run", recipe, "--output", job / f"ranks/0000{rank}-of-00002")
        assert result.exit_code == 0, result.output
        rank_folder = job / f"ranks/0000{rank}-of-00002"
        assert steps_of(rank_folder) == [9, 12, 15, 18]
        with open(rank_folder / "metrics.jsonl", "a") as f:  # what a torchrun rank logs after its summary
            f.write(
                json.dumps({"kind": "exchange", "rank": rank, "steps": 18, "sent_bytes": 1, "received_bytes": 1}) + "\n"
            )
    (job / "run.json").write_text(
        json.dumps({"format": RUN_FORMAT, "version": 1, "run_id": "ab" * 16, "state_id": None})
    )
    (job / "config.yaml").write_text((root / "rank0.yaml").read_text())
    write_manifest(job, [12, 15])
    return job


@pytest.fixture
def job(tmp_path, made_job):
    """``runs/a`` under tmp_path: a copy of the made job (by its real path)."""
    shutil.copytree(made_job, tmp_path / "runs" / "a", symlinks=True)
    return Path(os.path.realpath(tmp_path)) / "runs" / "a"


def planned(plan) -> list[tuple[str, str]]:
    return sorted((c.kind, str(c.path.relative_to(c.owner.parent.parent.parent))) for c in plan.candidates)


def test_rank_folder_names_read_back():
    from dsa_train.runs.run_folder import rank_folder_name, rank_name

    assert rank_name(rank_folder_name(3, 8)) == (3, 8)
    assert rank_name("00002-of-00002") is None and rank_name("1-of-2.bak") is None


# -- inspect-state ---------------------------------------------------------------------------
def test_inspect_state_shows_every_rank(job):
    result = invoke("inspect-state", job)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"{job}: a torchrun job's run folder, 2 ranks; complete checkpoints (steps): 12, 15" in out
    first, second = out.index("rank 0 of 2"), out.index("rank 1 of 2")
    assert first < second
    assert "160 rows of node_emb.weight" in out[first:second] and "160 x 8" in out[first:second]
    assert "140 rows of node_emb.weight" in out[second:] and "140 x 8" in out[second:]
    assert (
        str(job / RANK0 / "optimizer_state") in out[first:second]
        and str(job / RANK1 / "optimizer_state") in out[second:]
    )

    result = invoke("inspect-state", job, "--json", "--rows", "0:2,139", "--param", "node_emb.weight")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert (
        document["kind"] == "torchrun job"
        and document["world_size"] == 2
        and document["complete_checkpoints"] == [12, 15]
    )
    assert [(r["rank"], r["world_size"], r["folder"]) for r in document["ranks"]] == [
        (0, 2, str(job / RANK0)),
        (1, 2, str(job / RANK1)),
    ]
    for rank in document["ranks"]:
        entry = rank["params"]["node_emb.weight"]
        assert list(rank["params"]) == ["node_emb.weight"] and entry["shape"] == [ENTITIES[rank["rank"]], 8]
        assert (
            list(entry["rows"]) == ["0", "1", "139"] and len(entry["rows"]["139"]["m"]) == 8
        )  # each rank's local rows
    assert (
        document["ranks"][0]["params"]["node_emb.weight"]["rows"]
        != document["ranks"][1]["params"]["node_emb.weight"]["rows"]
    )


def test_inspect_state_rows_and_check_apply_per_rank(job):
    result = invoke(
        "inspect-state", job, "--rows", "150", "--param", "node_emb.weight"
    )  # rank 0 holds 160 rows, rank 1 only 140
    assert result.exit_code == 1 and result.stdout == ""
    assert "rank 1 of 2" in result.stderr and "has 140 rows" in result.stderr
    assert (
        invoke("inspect-state", job, "--rows", "139", "--param", "node_emb.weight").stdout.count("node_emb.weight[139]")
        == 2
    )

    result = invoke("inspect-state", job, "--check")
    assert result.exit_code == 0 and result.stdout.count("check: no problems in") == 2
    spec = RowSpec("node_emb.weight", (140, 8), "float32", "", "m|v")
    v = next(f for f in spec.fields if f.name == "v")
    with open(job / RANK1 / "optimizer_state" / "node_emb.weight.rows", "r+b") as f:
        os.pwrite(f.fileno(), struct.pack("<f", float("nan")), HEADER_BYTES + 7 * spec.row_bytes + v.offset)
    result = invoke("inspect-state", job, "--check")
    assert result.exit_code == 1
    rank1 = result.stdout.index("rank 1 of 2")
    assert "check: no problems in" in result.stdout[:rank1]
    assert "node_emb.weight: 1 row where v is NaN or infinite (row 7)" in result.stdout[rank1:]
    document = json.loads(invoke("inspect-state", job, "--check", "--json").stdout)
    assert document["check"] == {"ok": False} and [r["check"]["ok"] for r in document["ranks"]] == [True, False]


def test_inspect_state_of_one_rank_is_an_ordinary_run(job):
    alone = invoke("inspect-state", job / RANK1, "--json")
    assert alone.exit_code == 0, alone.output
    document = json.loads(alone.stdout)
    assert document["path"] == str(job / RANK1 / "optimizer_state") and "ranks" not in document
    assert document["params"]["node_emb.weight"]["shape"] == [140, 8]
    text = invoke("inspect-state", job / RANK1)
    assert text.exit_code == 0 and "rank 1 of 2" not in text.stdout and "140 x 8" in text.stdout


def test_inspect_state_on_another_machine_of_the_job(job):
    """There, the job's folder holds only that machine's ranks: no run.json, no checkpoints.json."""
    for name in ("run.json", "config.yaml", "checkpoints.json"):
        (job / name).unlink()
    shutil.rmtree(job / RANK0)
    result = invoke("inspect-state", job)
    assert result.exit_code == 0, result.output
    assert "1 rank of 2 here (the others' folders are on their own machines); no checkpoints.json here" in result.stdout
    assert "rank 1 of 2" in result.stdout and "rank 0 of 2" not in result.stdout and "140 x 8" in result.stdout
    assert json.loads(invoke("inspect-state", job, "--json").stdout)["complete_checkpoints"] is None


def test_inspect_state_refuses_a_linked_rank_folder(job, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (job / RANK1).rename(elsewhere)
    (job / RANK1).symlink_to(elsewhere)
    result = invoke("inspect-state", job)
    assert result.exit_code == 1 and result.stdout == ""
    assert "is a symbolic link" in result.stderr and "00001-of-00002" in result.stderr
    (job / RANK1).unlink()
    (job / "ranks").rename(tmp_path / "ranks")
    (job / "ranks").symlink_to(tmp_path / "ranks")
    result = invoke("inspect-state", job)
    assert result.exit_code == 1 and "is a symbolic link" in result.stderr


# -- clean ---------------------------------------------------------------------------------------
def test_clean_keeps_the_jobs_complete_steps_in_every_rank(job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = plan_clean([job], keep_last=1)
    assert planned(plan) == sorted(
        [("checkpoint", f"a/{rank}/checkpoints/{step_name(s)}") for rank in (RANK0, RANK1) for s in (9, 12)]
        + [("finished run's optimizer state", f"a/{rank}/optimizer_state") for rank in (RANK0, RANK1)]
    )  # the plain rule (the newest checkpoint of each rank) would take 15, the job's only resumable step
    kept = {(str(p.relative_to(job)), why) for p, why in plan.kept}
    assert (
        f"{RANK1}/checkpoints/{step_name(15)}",
        "one of the job's newest 1 complete checkpoints (--keep-last, checkpoints.json)",
    ) in kept
    assert any(
        p == f"{RANK0}/checkpoints/{step_name(18)}" and "newer than the job's newest complete" in why for p, why in kept
    )

    result = invoke("clean", "runs", "--yes")  # clean runs/ plans the same as clean runs/a
    assert result.exit_code == 0, result.output
    assert "Removed 6 items" in result.stdout
    for rank in (RANK0, RANK1):
        assert steps_of(job / rank) == [15, 18]
        assert not (job / rank / "optimizer_state").exists() and (job / rank / "run.json").is_file()
    assert json.loads((job / "checkpoints.json").read_text())["complete"] == [12, 15]
    assert sorted(p.name for p in job.iterdir()) == [".lock", "checkpoints.json", "config.yaml", "ranks", "run.json"]

    two = plan_clean([job], keep_last=2)  # 12 is gone, so the two newest listed steps leave nothing more
    assert not two.candidates


def test_clean_one_rank_folder_keeps_the_jobs_rule(job):
    plan = plan_clean([job / RANK1], keep_last=1)
    assert planned(plan) == [
        ("checkpoint", f"a/{RANK1}/checkpoints/{step_name(9)}"),
        ("checkpoint", f"a/{RANK1}/checkpoints/{step_name(12)}"),
        ("finished run's optimizer state", f"a/{RANK1}/optimizer_state"),
    ]
    assert planned(plan_clean([job / RANK1 / "checkpoints"], keep_last=1)) == planned(plan)[:2]
    assert planned(plan_clean([job / "ranks"], keep_last=1)) == planned(plan_clean([job], keep_last=1))
    for candidate in plan.candidates:
        remove(candidate)
    assert steps_of(job / RANK1) == [15, 18] and steps_of(job / RANK0) == [9, 12, 15, 18]


def test_keep_last_counts_listed_steps_and_zero_still_keeps_the_step_in_flight(job):
    write_manifest(job, [9, 12, 15])
    assert {c.path.name for c in plan_clean([job], keep_last=2).candidates if c.kind == "checkpoint"} == {step_name(9)}
    plan = plan_clean([job], keep_last=0)
    assert {c.path.name for c in plan.candidates if c.kind == "checkpoint"} == {step_name(s) for s in (9, 12, 15)}
    for candidate in plan.candidates:
        remove(candidate)
    assert steps_of(job / RANK0) == steps_of(job / RANK1) == [18]


def test_the_newest_complete_step_stays_while_a_rank_keeps_an_older_one(job):
    held = DirectoryLock(job / RANK0 / "checkpoints" / step_name(9) / "optimizer_state", purpose="live")
    held.acquire()  # someone opened rank 0's checkpoint 9: it stays, so 15 must stay in every rank
    try:
        plan = plan_clean([job], keep_last=0)
        assert sorted((c.owner.name, c.path.name) for c in plan.candidates if c.kind == "checkpoint") == [
            ("00000-of-00002", step_name(12)),
            ("00001-of-00002", step_name(9)),
            ("00001-of-00002", step_name(12)),
        ]
        why = {(p.parent.parent.name, p.name): w for p, w in plan.kept}
        for rank in ("00000-of-00002", "00001-of-00002"):
            assert (
                why[(rank, step_name(15))]
                == "the job's newest complete checkpoint: kept while a rank keeps an older one"
            )
        assert "optimizer state is open" in why[("00000-of-00002", step_name(9))]
    finally:
        held.release()


@pytest.mark.parametrize("case", ["no manifest", "not ours", "other world size", "newest step missing in a rank"])
def test_every_rank_checkpoint_stays_when_the_manifest_cannot_say_which_steps_are_complete(job, case):
    if case == "no manifest":  # another machine of the job: only its ranks' folders are there
        (job / "checkpoints.json").unlink()
        (job / "run.json").unlink()
        (job / "config.yaml").unlink()
    elif case == "not ours":
        (job / "checkpoints.json").write_text(json.dumps({"format": "other-tool", "world_size": 2, "complete": [15]}))
    elif case == "other world size":
        write_manifest(job, [12, 15], world_size=4)
    else:
        shutil.rmtree(job / RANK1 / "checkpoints" / step_name(15))
    for path in (job, job.parent, job / RANK0):
        plan = plan_clean([path], keep_last=1)
        assert [c.kind for c in plan.candidates] == ["finished run's optimizer state"] * (
            1 if path.name.startswith("0000") else 2
        )
        checkpoints = {p for p in path.rglob("checkpoints/0*")}
        assert checkpoints and {p for p, _ in plan.kept if p.parent.name == "checkpoints"} == checkpoints, (case, path)


def test_clean_never_follows_a_linked_rank_folder(job, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(job / RANK1, elsewhere)
    shutil.rmtree(job / RANK1)
    (job / RANK1).symlink_to(elsewhere)
    before = sorted(str(p) for p in elsewhere.rglob("*"))
    result = invoke("clean", job, "--keep-last", "0", "--yes")
    assert result.exit_code == 0, result.output
    assert f"keeping {job / RANK1}: a symbolic link: clean never follows links" in result.stderr
    assert sorted(str(p) for p in elsewhere.rglob("*")) == before and (job / RANK1).is_symlink()
    assert steps_of(job / RANK0) == [18]  # the real rank is cleaned: 18 is newer than the newest complete step
    assert "is a symbolic link" in invoke("clean", job / RANK1, "--yes").stderr

    (job / RANK1).unlink()
    (job / "ranks").rename(tmp_path / "real-ranks")
    (job / "ranks").symlink_to(tmp_path / "real-ranks")
    plan = plan_clean([job], keep_last=0)
    assert not plan.candidates and (job / "ranks", "a symbolic link: clean never follows links") in plan.kept


def test_foreign_entries_in_ranks_are_left_alone(job):
    (job / "ranks" / "notes").mkdir()
    (job / "ranks" / "notes" / "thesis.tex").write_text("precious")
    (job / "ranks" / "00005-of-00008").mkdir()  # named like a rank, but no run marker
    (job / "ranks" / "00005-of-00008" / "checkpoints").mkdir()
    plan = plan_clean([job], keep_last=0)
    kept = dict(plan.kept)
    assert "not named <rank>-of-<world>" in kept[job / "ranks" / "notes"]
    assert "no valid run.json" in kept[job / "ranks" / "00005-of-00008"]
    assert not any("notes" in str(c.path) or "00005" in str(c.path) for c in plan.candidates)


def test_a_live_job_is_left_alone(job):
    stale = plan_clean([job], keep_last=1)
    top = DirectoryLock(job, purpose="live")  # rank 0 holds the job's folder while it runs
    top.acquire()
    try:
        plan = plan_clean([job], keep_last=1)
        assert not plan.candidates and [why.startswith("run in progress") for p, why in plan.kept] == [True]
        one = plan_clean([job / RANK1], keep_last=1)
        assert not one.candidates and "which is in progress" in one.kept[0][1]
        with pytest.raises(DsaError, match="in progress"):
            plan_clean([job / "ranks"], keep_last=1)
        for candidate in (c for c in stale.candidates if c.kind == "checkpoint"):
            with pytest.raises(DsaError, match="left alone"):
                remove(candidate)
    finally:
        top.release()
    rank = DirectoryLock(job / RANK1, purpose="live")  # a rank on its own machine, still running
    rank.acquire()
    try:
        plan = plan_clean([job], keep_last=1)
        assert {c.owner.name for c in plan.candidates} == {"00000-of-00002"}
        assert any(p == job / RANK1 and w.startswith(f"run in progress, pid {os.getpid()}") for p, w in plan.kept)
    finally:
        rank.release()
    assert steps_of(job / RANK1) == [9, 12, 15, 18]


def test_removing_reads_checkpoints_json_again(job):
    plan = plan_clean([job], keep_last=1)
    write_manifest(job, [9])  # rewritten since the plan: 9 is now the newest complete step, 12 newer
    for candidate in (c for c in plan.candidates if c.kind == "checkpoint"):
        with pytest.raises(DsaError, match="checkpoints.json no longer lets it go"):
            remove(candidate)
    assert steps_of(job / RANK0) == steps_of(job / RANK1) == [9, 12, 15, 18]


def test_removing_refuses_ranks_replaced_by_a_link_since_the_plan(job, tmp_path):
    plan = plan_clean([job / RANK1], keep_last=1)
    (job / "ranks").rename(tmp_path / "elsewhere")
    (job / "ranks").symlink_to(tmp_path / "elsewhere")  # the planned rank folder's path now leads through a link
    for candidate in (c for c in plan.candidates if c.kind == "checkpoint"):
        with pytest.raises(DsaError, match=r"ranks/ is no longer a real folder\); left alone"):
            remove(candidate)
    assert steps_of(tmp_path / "elsewhere" / "00001-of-00002") == [9, 12, 15, 18]


# -- a real torchrun job -------------------------------------------------------------------------
@pytest.mark.slow
def test_a_real_two_rank_job_is_inspected_cleaned_and_resumed(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        (RECIPE % {"entities": 300}).replace("keep_checkpoints: 4, ", "") + "distributed: {slices: 4, timeout: 60}\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dsa_train", "run", str(recipe), "--nproc", "2", "-o", "runs/a"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    job = tmp_path / "runs" / "a"
    assert json.loads((job / "checkpoints.json").read_text())["complete"] == [15, 18]
    assert steps_of(job / RANK0) == steps_of(job / RANK1) == [12, 15, 18]

    result = invoke("inspect-state", job)
    assert result.exit_code == 0, result.output
    assert "rank 0 of 2" in result.stdout and "rank 1 of 2" in result.stdout
    assert result.stdout.count("150 rows of node_emb.weight") == 2  # 300 entities over 2 ranks

    result = invoke("clean", job, "--yes")
    assert result.exit_code == 0 and "Removed 6 items" in result.stdout, result.output
    assert steps_of(job / RANK0) == steps_of(job / RANK1) == [18]
    resumed = subprocess.run(
        [*command, "--resume", "--set", "train.max_steps=27"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((job / "checkpoints.json").read_text())["complete"] == [24, 27]


def test_one_answer_to_what_a_job_folder_is(tmp_path):
    """run_folder.is_job, the one test eval, the reader, clean and inspect-state ask: rank
    folders or the job's checkpoints.json make a job folder; a state directory's manifest.json
    says it is none, whatever it holds (a parameter named "ranks" included)."""
    from dsa_train.storage.format import MANIFEST
    from dsa_train.runs.run_folder import JOB_MANIFEST, RANKS, is_job

    ranks_only, listed, state, plain = (tmp_path / n for n in ("ranks-only", "listed", "state", "plain"))
    for folder in (ranks_only, listed, state, plain):
        folder.mkdir()
    (ranks_only / RANKS).mkdir()
    (listed / JOB_MANIFEST).write_text("{}")
    (state / RANKS).mkdir()
    (state / MANIFEST).write_text("{}")
    assert [is_job(f) for f in (ranks_only, listed, state, plain)] == [True, True, False, False]
