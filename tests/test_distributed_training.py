"""A torchrun job's KGE training on 1 to 4 gloo ranks on 127.0.0.1, one thread each.

The reference is the same recipe trained by one rank: the entity table (gathered from the
shards by global id), its Adam moments, the replicated relation table and the logged losses
must be bit-equal whatever the number of ranks, and close (not equal: the batch is computed
in slices there) to a plain single-process run. Ranks are started as torchrun starts them:
environment variables, then the CLI's own entry point (`train_rank`).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from dsa_train.recipe import parse_recipe

RECIPE = """
name: tiny
dataset:
  kind: synthetic
  synthetic: {entities: 300, relations: 5, triples: 3000, valid: 50, test: 50, clusters: 6, seed: 1}
model: {kind: %(model)s, dim: 8, init_std: 0.1, dropout: %(dropout)s, relation_dropout: %(reldrop)s, embedding_storage: %(storage)s}
train: {epochs: 2, max_steps: %(steps)s, batch_size: 256, negatives: 32, checkpoint_every: 3, log_every: 1, device: cpu, loss: %(loss)s, regularization: %(reg)s}
optimizer: {kind: dsa, lr: 0.05}
eval: {final_splits: []}
distributed: {slices: 4, timeout: 60}
"""


def recipe_text(
    model="transe", dropout=0.0, steps=7, loss="cross_entropy", reg=0.0, storage="memory", reldrop=0.0
) -> str:
    return RECIPE % dict(
        model=model, dropout=dropout, steps=steps, loss=loss, reg=reg, storage=storage, reldrop=reldrop
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int, world: int, port: int, text: str, folder: str, resume: bool, overrides: tuple[str, ...] = ()
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    from dsa_train.distributed.group import from_environment
    from dsa_train.storage.inspect import StateInspector
    from dsa_train.train.sharded_run import train_rank

    recipe = parse_recipe(text, source="test")
    training, _, _ = train_rank(recipe, from_environment(), output=Path(folder), resume=resume, overrides=overrides)
    task = training.task
    local = torch.arange(task.layout.rows_here)
    m, v = StateInspector(training.run.state_dir(recipe)).read_rows("node_emb.weight", local.numpy())
    weights = task.model.node_emb.weight.detach().clone()
    torch.save(
        {
            "ids": task.shards.sharding.ids_of(rank, local),
            "weights": weights,
            "m": torch.from_numpy(np.array(m)),
            "v": torch.from_numpy(np.array(v)),
            "relations": task.model.rel_emb.weight.detach().clone(),
            "final": training.final_metrics,
        },
        os.path.join(folder, f"out{rank}.pt"),
    )


def train_job(world: int, folder: Path, text: str, *, resume: bool = False, overrides: tuple[str, ...] = ()) -> dict:
    """Run a job of ``world`` ranks; returns the whole table, its moments, relations, losses."""
    mp.start_processes(
        _rank_main, args=(world, _free_port(), text, str(folder), resume, overrides), nprocs=world, start_method="spawn"
    )
    parts = [torch.load(folder / f"out{r}.pt") for r in range(world)]
    rows = sum(len(p["ids"]) for p in parts)
    whole = {key: torch.empty(rows, parts[0][key].shape[1], dtype=parts[0][key].dtype) for key in ("weights", "m", "v")}
    for p in parts:
        for key in whole:
            whole[key][p["ids"]] = p[key]
    whole["relations"] = parts[0]["relations"]
    whole["final"] = parts[0]["final"]
    assert all(p["final"] == whole["final"] for p in parts)  # every rank reports the combined ranking
    assert all(torch.equal(p["relations"], whole["relations"]) for p in parts)  # every copy took the same steps
    metrics = folder / "ranks" / f"00000-of-{world:05d}" / "metrics.jsonl"
    whole["losses"] = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    return whole


def assert_same(a: dict, b: dict) -> None:
    for key in ("weights", "m", "v", "relations"):
        assert torch.equal(a[key], b[key]), key
    assert a["losses"] == b["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_tables_moments_and_losses_do_not_depend_on_the_number_of_ranks(tmp_path, world):
    text = recipe_text()
    one = train_job(1, tmp_path / "one", text)
    many = train_job(world, tmp_path / "many", text)
    assert len(one["losses"]) == 7
    assert_same(one, many)
    assert (one["m"] != 0).any() and not torch.equal(one["weights"], many["weights"] * 0)


@pytest.mark.slow
def test_the_default_slices_give_the_same_bits_on_one_and_eight_ranks(tmp_path):
    """The promise as docs/distributed.md makes it, at its ends: the default
    ``distributed.slices`` (8) on 1 rank and on 8 (eight processes, so slow on 2 cores)."""
    text = recipe_text().replace("distributed: {slices: 4, timeout: 60}", "distributed: {timeout: 120}")
    assert parse_recipe(text, source="test").distributed.slices == 8
    one = train_job(1, tmp_path / "one", text)
    eight = train_job(8, tmp_path / "eight", text)
    assert len(one["losses"]) == 7
    assert_same(one, eight)
    assert (one["m"] != 0).any() and not torch.equal(one["weights"], eight["weights"] * 0)


@pytest.mark.slow
def test_a_sharded_disk_table_is_exact_and_holds_its_share_of_the_table(tmp_path):
    """Each rank's shard a DiskEmbedding of its rows (weights and moments in one file): the
    same tables as in memory, for 1 and 3 ranks; 2 ranks' files are half the table each."""
    from dsa_train.distributed.sharding import RowSharding
    from dsa_train.nn import DiskEmbedding

    text = recipe_text(storage="disk")
    one, three = train_job(1, tmp_path / "one", text), train_job(3, tmp_path / "three", text)
    assert_same(one, three)
    assert_same(one, train_job(1, tmp_path / "memory", recipe_text()))
    sharding = RowSharding(300, 2, 0)  # the recipe's 300 entities, train.seed 0
    for rank in range(2):
        shard = DiskEmbedding(
            sharding.rows_of(rank),
            8,
            path=tmp_path / f"s{rank}.table",
            std=0.1,
            first_row=rank * sharding.block,
            total_rows=300,
        )
        assert torch.equal(
            shard.weight.detach(), sharding.initial_rows(rank, 8, std=0.1, seed=0)
        )  # drawn as the whole table is


@pytest.mark.slow
@pytest.mark.parametrize("model", ["distmult", "complex", "rotate"])
def test_dropout_softplus_n3_stay_exact(tmp_path, model):
    text = recipe_text(
        model=model, dropout=0.2, steps=4, loss="softplus", reg=0.01, reldrop=0.0 if model == "rotate" else 0.3
    )
    one = train_job(1, tmp_path / "one", text)
    assert_same(one, train_job(3, tmp_path / "three", text))
    if model == "distmult":  # the relation mask is applied: without it the same run ends elsewhere
        plain = train_job(
            1, tmp_path / "plain", recipe_text(model=model, dropout=0.2, steps=4, loss="softplus", reg=0.01)
        )
        assert not torch.equal(one["relations"], plain["relations"])


@pytest.mark.parametrize("slices, normalize", [(1, False), (3, False), (3, True)])
def test_a_sharded_step_is_the_single_process_step(tmp_path, slices, normalize):
    """One rank's sliced step against KGETask's plain loss on the same tables: the same loss
    and gradients up to float rounding (the slices sum in another order)."""
    import torch.distributed as dist

    from dsa_train.distributed.group import World
    from dsa_train.train.kge import KGETask
    from dsa_train.train.sharded_kge import ShardedKGETask

    recipe = parse_recipe(
        recipe_text(loss="margin", reg=0.01),
        source="test",
        overrides=[f"distributed.slices={slices}", f"model.normalize_entities={str(normalize).lower()}"],
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        sharded = ShardedKGETask(recipe, torch.device("cpu"), World(0, 1, 0))
        torch.manual_seed(0)
        plain = KGETask(recipe, torch.device("cpu"))
        ids = sharded.shards.sharding.ids_of(0, torch.arange(sharded.layout.rows_here))
        with torch.no_grad():
            plain.model.node_emb.weight[ids] = sharded.model.node_emb.weight
            plain.model.rel_emb.weight.copy_(sharded.model.rel_emb.weight)
        picked = torch.arange(0, 2000, 9)
        torch.manual_seed(5)
        loss = sharded.gradients(picked)
        torch.manual_seed(5)
        reference = plain.loss(picked)
        reference.backward()
    finally:
        dist.destroy_process_group()
    assert loss == pytest.approx(reference.item(), rel=1e-5)
    entity_grad = plain.model.node_emb.weight.grad.coalesce().to_dense()[ids]
    torch.testing.assert_close(sharded.model.node_emb.weight.grad.to_dense(), entity_grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(
        sharded.model.rel_emb.weight.grad.to_dense(),
        plain.model.rel_emb.weight.grad.coalesce().to_dense(),
        rtol=1e-4,
        atol=1e-7,
    )


def _rank_until_error(rank: int, world: int, port: int, text: str, folder: str, resume: bool) -> None:
    """A rank that writes the error it stopped with (the CLI would print it) instead of raising."""
    from dsa_train.errors import DsaError

    try:
        _rank_main(rank, world, port, text, folder, resume)
    except DsaError as e:
        Path(folder, f"error{rank}.txt").write_text(e.message)


def _start(world: int, folder: Path, text: str):
    folder.mkdir(parents=True, exist_ok=True)
    return mp.start_processes(
        _rank_until_error,
        args=(world, _free_port(), text, str(folder), False),
        nprocs=world,
        start_method="spawn",
        join=False,
    )


def _train_records(folder: Path, rank: int, world: int) -> int:
    metrics = folder / "ranks" / f"{rank:05d}-of-{world:05d}" / "metrics.jsonl"
    return metrics.read_text().count('"kind": "train"') if metrics.exists() else 0


def _wait_for(condition, seconds: float) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_lost_rank_stops_the_others_with_the_rank_and_step_and_resume_is_exact(tmp_path, fault):
    """kill -9 (or SIGSTOP) one rank mid-run: the other stops within the recipe's timeout (4 s;
    a stopped rank is waited for that long at least; under 12 s in all, for a busy machine) with
    an error naming itself and the step;
    resuming finishes bit-equal to a run never interrupted."""
    import signal
    import time

    text = recipe_text(steps=16).replace("timeout: 60", "timeout: 4")
    reference = train_job(2, tmp_path / "reference", text)
    folder = tmp_path / "interrupted"
    job = _start(2, folder, text)
    victim = job.processes[1].pid
    _wait_for(lambda: _train_records(folder, 0, 2) >= 7, 60)  # past the checkpoint of step 6
    os.kill(victim, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    stopped = time.monotonic()
    job.processes[0].join(60)
    waited = time.monotonic() - stopped
    if fault == "hung":
        os.kill(victim, signal.SIGKILL)
    assert not job.processes[0].is_alive()
    message = (folder / "error0.txt").read_text()
    assert message.startswith("rank 0 of 2 stopped at step ") and "another rank stopped answering" in message
    assert int(message.split("at step ")[1].split()[0]) >= 8
    if fault == "hung":  # a stopped peer sends nothing: only the recipe's timeout can end the wait
        assert waited >= 3.9, f"stopped after {waited:.1f} s, before the recipe's 4 s timeout"
    # the 4 s timeout, plus the time to write the error and exit on a busy 2-core machine: a rank
    # that waits a second timeout (or torch's default 30 minutes) fails here
    assert waited < 12, f"the surviving rank took {waited:.1f} s to stop after a 4 s timeout"
    resumed = train_job(2, folder, text, resume=True)
    assert_same(resumed, reference)


@pytest.mark.slow
def test_sharded_filtered_ranking_equals_the_single_process_ranking(tmp_path):
    """Trained by 3 ranks, each scoring the entities it holds, the final filtered metrics equal
    those of one rank scoring all entities (which is the plain ranking: one chunk, id order),
    and the plain ranking of the same table in one process; in chunks and with sampled negatives too."""

    text = recipe_text(steps=5).replace(
        "final_splits: []", "final_splits: [test], entity_chunk: %d, sampled_negatives: %s"
    )
    for chunk, sampled in ((1000, "null"), (64, "null"), (1000, 40)):
        recipe_yaml = text % (chunk, sampled)
        one = train_job(1, tmp_path / f"one-{chunk}-{sampled}", recipe_yaml)
        three = train_job(3, tmp_path / f"three-{chunk}-{sampled}", recipe_yaml)
        assert one["final"] == three["final"]
        assert 0 < one["final"]["test"]["both"]["mrr"] < 1
    assert plain_test_metrics(recipe_yaml, one, sampled_negatives=40) == one["final"]["test"]


def plain_test_metrics(recipe_yaml: str, job: dict, **ranking) -> dict:
    """The test metrics of one process ranking a job's final tables (KGETask's own scoring, in
    chunks of 1,000 entities), with ``ranking``'s options to ``evaluate_link_prediction``."""
    from dsa_train.eval import evaluate_link_prediction
    from dsa_train.train.kge import KGETask

    recipe = parse_recipe(recipe_yaml, source="test")
    torch.manual_seed(0)
    plain = KGETask(recipe, torch.device("cpu"))
    with torch.no_grad():
        plain.model.node_emb.weight.copy_(job["weights"])
        plain.model.rel_emb.weight.copy_(job["relations"])
    plain.model.eval()
    metrics = evaluate_link_prediction(
        plain.model.score_entities,
        plain.kg.rows("test", slice(None)),
        plain.kg.filter_index(),
        num_entities=plain.kg.num_entities,
        batch_size=recipe.eval.batch_size,
        entity_chunk=1000,
        seed=recipe.train.seed,
        **ranking,
    )
    return {side: m.as_dict() for side, m in metrics.items()}


def test_sharded_ranking_scores_normalized_entities_as_one_process(tmp_path):
    """With model.normalize_entities the ranks score unit rows, anchors and candidates alike:
    two ranks give the metrics of the plain ranking of the same table in one process."""

    text = recipe_text(steps=5).replace("final_splits: []", "final_splits: [test], entity_chunk: 64")
    text = text.replace("init_std: 0.1,", "init_std: 0.1, normalize_entities: true,")
    two = train_job(2, tmp_path / "two", text)
    assert plain_test_metrics(text, two) == two["final"]["test"]


@pytest.fixture(scope="module")
def eleven_steps_on_two_ranks(tmp_path_factory):
    return train_job(2, tmp_path_factory.mktemp("reference"), recipe_text(steps=11))


@pytest.mark.slow
@pytest.mark.parametrize("before, after, storage", [(2, 3, "memory"), (4, 1, "memory"), (3, 2, "disk")])
def test_resuming_at_another_number_of_ranks_is_exact(tmp_path, before, after, storage, eleven_steps_on_two_ranks):
    """Stopped after a checkpoint with one number of ranks, resumed with another: the rows and
    their moments move to their new owners, and the run ends bit-equal to one never stopped
    (disk shards too, whose checkpoints hold deltas on the table as drawn)."""
    folder = tmp_path / "job"
    train_job(before, folder, recipe_text(steps=6, storage=storage))
    resumed = train_job(
        after, folder, recipe_text(steps=6, storage=storage), resume=True, overrides=("train.max_steps=11",)
    )
    assert_same(resumed, eleven_steps_on_two_ranks)
    assert json.loads((folder / "checkpoints.json").read_text())["world_size"] == after


@pytest.mark.slow
def test_the_cli_trains_over_processes_resumes_at_another_count_and_reports_errors(tmp_path):
    """`dsa-train run --nproc 2` end to end; `--resume` with 3 processes reshards; a second run
    into the same folder stops rank 0 with its reason and rank 1 pointing to it, one summary line from the
    launcher, exit code 1 and no traceback."""
    import subprocess
    import sys

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(recipe_text(steps=4))
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(temporary)}
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "dsa_train", "run", str(recipe), "-o", str(tmp_path / "run"), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    first = run("--nproc", "2")
    assert first.returncode == 0, first.stderr
    assert "4 steps, 0 epochs" in first.stdout and "on 2 ranks" in first.stdout
    manifest = json.loads((tmp_path / "run" / "checkpoints.json").read_text())
    assert manifest["world_size"] == 2 and manifest["complete"][-1] == 4
    recipe.write_text(recipe_text(steps=4).replace("lr: 0.05", "lr: 0.07"))  # edited since: the run's own recipe wins
    resumed = run("--nproc", "3", "--resume", "--set", "train.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr
    assert "optimizer.lr (0.05 in the run, 0.07 in the recipe)" in resumed.stderr
    assert "resharded step 4 from 2 ranks to 3" in resumed.stderr and "6 steps" in resumed.stdout
    again = run("--nproc", "2")
    assert again.returncode == 1
    assert "already exists and is not empty" in again.stderr and "rank 0 could not open the run folder" in again.stderr
    assert "ranks 0, 1 of 2 failed" in again.stderr and "Traceback" not in again.stderr + again.stdout
    # The launcher's per-rank folders went with the jobs, failed or not (torch's own compile
    # cache, torchinductor_<user>, is created by importing torch._dynamo and kept for reuse).
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []


NODE2VEC = """
name: karate-sharded
dataset: {kind: karate, link_split: [0.1, 0.15]}
model:
  kind: node2vec
  dim: 8
  embedding_storage: %(storage)s
  node2vec: {walk_length: 6, context_size: 3, walks_per_node: 3, negatives: 2}
train: {epochs: 3, batch_size: 12, log_every: 1, checkpoint_every: 4, device: cpu}
optimizer: {kind: dsa, lr: 0.05}
eval: {final_splits: [test]}
distributed: {slices: 3, timeout: 60}
"""


def _node2vec_rank(rank: int, world: int, port: int, text: str, folder: str, resume: bool) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    from dsa_train.distributed.group import from_environment
    from dsa_train.train.sharded_run import train_rank

    training, _, _ = train_rank(
        parse_recipe(text, source="test"), from_environment(), output=Path(folder), resume=resume
    )
    shards = training.task.shards
    local = torch.arange(shards.rows_here)
    ids = shards.sharding.ids_of(rank, local)
    torch.save(
        {"ids": ids, "weights": training.task.model.embedding.weight.detach().clone(), "final": training.final_metrics},
        os.path.join(folder, f"n2v{rank}.pt"),
    )


def node2vec_job(world: int, folder: Path, text: str) -> dict:
    mp.start_processes(
        _node2vec_rank, args=(world, _free_port(), text, str(folder), False), nprocs=world, start_method="spawn"
    )
    parts = [torch.load(folder / f"n2v{r}.pt") for r in range(world)]
    weights = torch.empty(sum(len(p["ids"]) for p in parts), parts[0]["weights"].shape[1])
    for p in parts:
        weights[p["ids"]] = p["weights"]
    assert all(p["final"] == parts[0]["final"] for p in parts)
    metrics = folder / "ranks" / f"00000-of-{world:05d}" / "metrics.jsonl"
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]
    return {"weights": weights, "final": parts[0]["final"], "losses": losses}


@pytest.mark.slow
def test_node2vec_over_ranks_is_exact_and_evaluates_alike(tmp_path):
    """node2vec's walks drawn per slice, its rows exchanged like KGE's: the node table, the
    losses and the probe and link metrics are the same for 1 and 3 ranks (memory) and 2 ranks
    (disk shards)."""
    one = node2vec_job(1, tmp_path / "one", NODE2VEC % {"storage": "memory"})
    three = node2vec_job(3, tmp_path / "three", NODE2VEC % {"storage": "memory"})
    two = node2vec_job(2, tmp_path / "two", NODE2VEC % {"storage": "disk"})
    assert len(one["losses"]) == 9 and one["losses"][-1] < one["losses"][0]
    for other in (three, two):
        assert torch.equal(other["weights"], one["weights"])
        assert other["losses"] == one["losses"] and other["final"] == one["final"]
    assert set(one["final"]["test"]) == {"probe", "link"}


@pytest.mark.slow
def test_eval_of_a_job_starts_its_ranks_and_gives_the_training_metrics(tmp_path):
    """`dsa-train eval RUN` on a job's folder starts as many processes as wrote its checkpoint,
    each scores the entities it holds, and rank 0 prints the metrics the training ended with."""
    import subprocess
    import sys

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(recipe_text(steps=4).replace("final_splits: []", "final_splits: [test]"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trained = subprocess.run(
        [sys.executable, "-m", "dsa_train", "run", str(recipe), "-o", str(tmp_path / "run"), "--nproc", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr
    final = [
        json.loads(line)
        for line in (tmp_path / "run" / "ranks" / "00000-of-00003" / "metrics.jsonl").read_text().splitlines()
    ]
    expected = next(r for r in final if r["kind"] == "summary")["final"]["test"]
    scored = subprocess.run(
        [sys.executable, "-m", "dsa_train", "eval", str(tmp_path / "run"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert scored.returncode == 0, scored.stderr
    document = json.loads(scored.stdout)
    assert document["checkpoint"] == 4 and document["metrics"] == expected


@pytest.mark.slow
def test_fast_mode_sends_fewer_bytes_and_stays_within_its_tolerance(tmp_path):
    """distributed.exact: false (rows fetched once per rank, gradient rows summed per rank
    before they travel): fewer bytes than exact mode, and tables within the tolerance
    docs/distributed.md gives of the exact run after 7 steps."""
    exact_text = recipe_text()
    fast_text = exact_text.replace("timeout: 60}", "timeout: 60, exact: false}")
    exact = train_job(3, tmp_path / "exact", exact_text)
    fast = train_job(3, tmp_path / "fast", fast_text)
    torch.testing.assert_close(fast["weights"], exact["weights"], rtol=0, atol=1e-5)
    torch.testing.assert_close(fast["relations"], exact["relations"], rtol=0, atol=1e-5)
    assert fast["losses"] == pytest.approx(exact["losses"], rel=1e-5)
    sent = {}
    for mode in ("exact", "fast"):
        records = (tmp_path / mode / "ranks" / "00000-of-00003" / "metrics.jsonl").read_text().splitlines()
        sent[mode] = next(json.loads(r) for r in records if '"exchange"' in r)["sent_bytes"]
    assert sent["fast"] < 0.7 * sent["exact"]


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["memory", "disk"])
def test_open_run_and_export_bring_a_jobs_rows_together_by_global_id(tmp_path, storage):
    """open_run on a torchrun job's folder reads every rank's shard of its newest complete
    checkpoint: the whole table by global id, as the ranks held it at the end."""
    from dsa_train import open_run
    from dsa_train.results import export_run

    whole = train_job(2, tmp_path / "job", recipe_text(steps=6, storage=storage))  # checkpoints at 3 and 6
    trained = open_run(tmp_path / "job")
    assert trained.step == 6
    assert torch.equal(trained.weights("entities"), whole["weights"])
    assert torch.equal(trained.weights("relations"), whole["relations"])
    export_run(trained, tmp_path / "out", "npy", chunk_rows=64)
    assert np.array_equal(np.load(tmp_path / "out" / "entities.npy"), whole["weights"].numpy())
    assert not torch.equal(open_run(tmp_path / "job", checkpoint=3).weights("entities"), whole["weights"])
    top = trained.predict(head=0, relation=1, k=5)
    scores = -(whole["weights"][0] + whole["relations"][1] - whole["weights"]).norm(dim=1)  # TransE, p = 2
    assert [a.id for a in top] == torch.topk(scores, 5).indices.tolist()
