"""The shell scripts for Colab and GPU boxes: help, refusals, and a check on this machine; the
benchmark scripts' quick versions."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_script(script, *args, timeout=600, **options):
    """``python script args...`` with its output captured as text."""
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, **options)


def bash(*args, **env):
    environment = {
        **os.environ,
        "PYTHON": sys.executable,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        **env,
    }
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, env=environment, timeout=300)


@pytest.mark.parametrize("script", ["setup_box.sh", "run_benchmarks.sh"])
def test_help_and_unknown_options(script):
    shown = bash(SCRIPTS / script, "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("Usage: scripts/")
    wrong = bash(SCRIPTS / script, "--bogus")
    assert wrong.returncode == 2 and "unknown option --bogus" in wrong.stderr


@pytest.mark.parametrize(
    "script,args", [("setup_box.sh", ["--no-install", "--check-only"]), ("run_benchmarks.sh", ["--quick"])]
)
def test_a_failing_step_stops_the_script(tmp_path, script, args):
    """The first command that fails ends the script with its status: nothing after it runs."""
    failing = tmp_path / "python"
    failing.write_text('#!/bin/sh\necho ran "$@"\nexit 3\n')
    failing.chmod(0o755)
    result = bash(
        SCRIPTS / script,
        *args,
        "--dir" if script == "run_benchmarks.sh" else "--state-dir",
        tmp_path,
        PYTHON=str(failing),
    )
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert result.stdout.count("ran ") == 1, result.stdout  # one failed step, the next one never ran


def test_setup_box_checks_this_machine(tmp_path):
    result = bash(SCRIPTS / "setup_box.sh", "--no-install", "--check-only", "--state-dir", tmp_path / "state")
    assert result.returncode == 0, result.stderr
    for line in ("python ", "torch ", "cuda ", "fast path ", f"state disk  {tmp_path / 'state'}"):
        assert line in result.stdout


@pytest.mark.slow
def test_out_of_core_benchmark_runs_quick(tmp_path):
    """The scale benchmark's small version runs end to end and prints every figure."""
    script = SCRIPTS / "bench_out_of_core.py"
    result = run_script(script, "--dir", tmp_path, "--quick")
    assert result.returncode == 0, result.stderr
    for line in (
        "disk random 4 KiB reads",
        "cold rows paged in",
        "with prefetch / without",
        "peak resident anonymous memory",
    ):
        assert line in result.stdout
    assert not list(tmp_path.iterdir()), "the benchmark left its table behind"


@pytest.mark.slow
def test_partitioned_node2vec_benchmark_runs_quick(tmp_path):
    """Both orders train on the one table; partition order's pool reads every partition and
    writes back what it trained; the table and state are removed afterwards."""
    env = {**os.environ, "DSA_DATA_ROOT": str(tmp_path / "data")}
    script = SCRIPTS / "bench_partitioned_node2vec.py"
    result = run_script(script, "--dir", tmp_path / "b", "--quick", env=env)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    random_order, partitioned = summary["results"]["random"], summary["results"]["partitioned"]
    assert random_order["steps"] == 5 and partitioned["steps"] == 8 and summary["ratio"] > 0
    buffer = partitioned["buffer"]
    assert (
        buffer["loads"] >= 4
        and buffer["read_bytes"] >= 4 * buffer["partition_mib"] * 2**20 * 0.99
        and buffer["written_bytes"] > 0
    )
    assert not list((tmp_path / "b").iterdir()), "the benchmark left its table behind"


@pytest.mark.slow
def test_partitioned_benchmark_runs_quick(tmp_path):
    """The partition-order benchmark's small version measures every regime it names, its
    partitioned steps stay in the buffer (every state waited for), and it leaves nothing."""
    script = SCRIPTS / "bench_partitioned.py"
    result = run_script(script, "--dir", tmp_path, "--quick")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(summary["results"]) == {
        "random, no prefetch",
        "random, prefetch",
        "in the page cache",
        "held in memory",
        "partitioned",
    }
    part = summary["results"]["partitioned"]
    assert (
        part["states"] == 3 and part["read_gb"] >= 3 * part["partition_gb"] * 0.99
    )  # 2 to start, 1 swapped in (at least)
    assert summary["sequential_read_mb_s"] > 0 and summary["sequential_write_mb_s"] > 0
    assert "partitioned / random with prefetch" in result.stdout
    assert not list(tmp_path.iterdir()), "the benchmark left its table behind"


@pytest.mark.slow
def test_import_benchmark_runs_quick(tmp_path):
    """The import benchmark's small version runs both parsers and checks they agree on the counts."""
    result = run_script(
        SCRIPTS / "bench_import.py",
        "--triples",
        "20000",
        "--entities",
        "3000",
        "--held-out",
        "100",
        "--folder",
        tmp_path,
        "--json",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    report = json.loads(result.stdout)
    assert report["counts (entities relations train valid test)"].split()[2:] == ["20000", "100", "100"]
    assert report["import"]["peak_rss"] > 0 and report["speedup (old / import)"] > 0


def processes_naming(folder: Path) -> list[int]:
    """Processes whose command line names ``folder`` (the benchmarks' children and neighbours do)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(folder).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.slow
def test_throughput_benchmark_one_process_per_optimizer(tmp_path):
    """Each optimizer trains in a child process of its own and the figures come out; the
    children's run folders are removed."""
    result = run_script(
        SCRIPTS / "bench_throughput.py",
        SCRIPTS.parent / "recipes" / "quickstart.yaml",
        *("--steps", "3", "--warmup", "1", "--repeats", "1", "--dir", tmp_path),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "quickstart: " in out and "3 timed steps after 1 untimed steps" in out
    assert "fresh process with a fresh run folder (the optimizer state starts cold)" in out
    assert "round 1 (dsa first):" in out and "median over 1 round:" in out
    for kind in ("dsa", "sparse_adam"):
        assert (
            len(
                re.findall(
                    rf"^  {kind} +[\d,]+ triples/s  median step +[\d.]+ ms  wall +[\d.]+ s  CPU +[\d.]+ s", out, re.M
                )
            )
            == 2
        )
    assert re.search(r"dsa / sparse_adam: throughput [\d.]+x \(rounds [\d.]+-[\d.]+\), CPU time [\d.]+x \(rounds", out)
    assert not list(tmp_path.iterdir()), "a child left its run folder behind"
    assert not processes_naming(tmp_path)


@pytest.mark.slow
def test_contention_benchmark_stops_its_neighbours(tmp_path):
    """Both optimizers measured next to the CPU neighbour, each in its own process; the
    neighbours worked meanwhile, and no neighbour process or file is left afterwards."""
    result = run_script(
        SCRIPTS / "bench_contention.py",
        *("--steps", "3", "--warmup", "1", "--repeats", "1", "--conditions", "cpu", "--dir", tmp_path),
        "--json",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    measurements = report["measurements"]
    assert [(m["condition"], m["kind"]) for m in measurements] == [("cpu", "dsa"), ("cpu", "sparse_adam")]
    assert len({m["pid"] for m in measurements} | {os.getpid()}) == 3
    for m in measurements:
        assert m["steps"] == 3 and m["wall_s"] > 0 and m["cpu_s"] > 0 and m["items_per_s"] > 0
        assert m["neighbours"]["cpu"]["matmuls"] > 0
        for pid in m["neighbour_pids"]:
            assert not Path(f"/proc/{pid}").exists(), f"neighbour {pid} is still there"
    summary = report["summary"]["cpu"]
    dsa, sparse_adam = (
        measurements  # one repeat: each ratio is this repeat's, and the verdict follows from it and the target
    )
    for key, field in (("wall", "wall_s"), ("cpu", "cpu_s")):
        ratio = dsa[field] / sparse_adam[field]
        assert summary["ratio"][key]["median"] == pytest.approx(ratio) and summary["ratio"][key][
            "max"
        ] == pytest.approx(ratio)
        assert summary["target"][key] == ("met" if ratio <= report["target"] else "MISSED"), (
            key,
            ratio,
            summary["target"][key],
        )
    assert "repeat 1 cpu     dsa" in result.stderr
    assert not list(tmp_path.iterdir()), "a run folder or the neighbour's folder was left behind"
    assert not processes_naming(tmp_path)


@pytest.mark.slow
def test_optimizer_benchmark_measures_every_regime(tmp_path):
    """The optimizer benchmark's three regimes run at a tiny size, each in a fresh process, and
    report ratios, the equality check and the thread-hygiene figures; nothing is left behind."""
    import json

    result = run_script(
        SCRIPTS / "bench_optimizer.py",
        "--rows",
        "20000",
        "--dim",
        "16",
        "--lookups",
        "2048",
        "--steps",
        "3",
        "--ooc-steps",
        "2",
        "--repeats",
        "1",
        "--skip-memory",
        "--state-dir",
        tmp_path,
        "--json",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert {(r["regime"], r["distribution"]) for r in report["speed"]} == {
        (regime, dist) for regime in ("cold", "warm", "out-of-core") for dist in ("uniform", "powerlaw")
    }
    cold = next(r for r in report["runs"] if r["regime"] == "cold")
    assert cold["steps"] == 10  # one epoch: 20,000 rows / 2,048 lookups
    assert cold["ratio_of_totals"] > 0 and "window_ratio" in cold
    warm = next(r for r in report["runs"] if r["regime"] == "warm")
    assert warm["matmul_after_dsa_vs_after_sparse_adam"] > 0 and warm["threads"] >= 1
    assert not list(tmp_path.iterdir()), "the benchmark left state behind"


@pytest.mark.slow
def test_relation_categories_by_hand_and_from_a_run(tmp_path):
    """Categories as Bordes et al. define them, on relations built to be each kind; on a real
    run, the queries of the four categories add up to the split and its MRR."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("relation_categories", SCRIPTS / "relation_categories.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import numpy as np

    one_one = [(i, 0, i + 10) for i in range(4)]  # a head, a tail
    one_many = [(0, 1, t) for t in range(10, 14)] + [(1, 1, t) for t in range(14, 18)]  # 4 tails per head
    many_one = [(h, 2, 20) for h in range(4)] + [(h, 2, 21) for h in range(4, 8)]  # 4 heads per tail
    many_many = [(h, 3, t) for h in range(4) for t in range(10, 14)]
    triples = np.array(one_one + one_many + many_one + many_many + [(5, 1, 30)])  # a 1-N relation: tph (9/3) = 3
    assert module.categories(triples, 5).tolist() == [0, 1, 2, 3, 0]  # relation 4 has no triple

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        "name: tiny\ndataset: {kind: synthetic, synthetic: {entities: 300, relations: 6, triples: 4000, valid: 100, test: 100, clusters: 10, seed: 1}}\n"
        "model: {kind: distmult, dim: 16}\ntrain: {epochs: 1, batch_size: 256, negatives: 64}\noptimizer: {kind: dsa, lr: 0.01}\neval: {final_splits: [test]}\n"
    )
    env = {**os.environ, "DSA_DATA_ROOT": str(tmp_path / "data")}

    def run(*a):
        return run_script(*map(str, a), env=env, timeout=300)

    assert run("-m", "dsa_train", "run", recipe, "-o", tmp_path / "run").returncode == 0
    scored = run("-m", "dsa_train", "eval", tmp_path / "run", "--json", "--save-ranks", tmp_path / "ranks.tsv")
    assert scored.returncode == 0, scored.stderr
    result = run(SCRIPTS / "relation_categories.py", tmp_path / "run", tmp_path / "ranks.tsv")
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout.strip().splitlines()[-1])["categories"]
    assert sum(c["queries"] for c in table.values()) == 200 and sum(c["relations"] for c in table.values()) == 6
    mrr = json.loads(scored.stdout)["metrics"]["both"]["mrr"]
    pooled = sum(c["mrr"] * c["queries"] for c in table.values() if c["queries"]) / 200
    assert pooled == pytest.approx(mrr, rel=1e-9)


@pytest.mark.slow
def test_one_vs_all_benchmark_runs_small(tmp_path):
    """Every configuration runs; 1-vs-all updates every entity row a step, sampled fewer."""
    script = SCRIPTS / "bench_one_vs_all.py"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = run_script(script, "--entities", "1500", "--dim", "8", "--batch", "32", "--steps", "2", env=env)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])["results"]
    assert set(found) == {
        "sampled, dsa",
        "sampled, sparse_adam",
        "all, dsa",
        "all, sparse_adam",
        "all in chunks of 375, dsa",
    }
    assert found["all, dsa"]["rows_per_step"] == found["all in chunks of 375, dsa"]["rows_per_step"] == 1500
    assert found["sampled, dsa"]["rows_per_step"] < 1500
    left = [
        p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")
    ]  # torch's own cache, made once per user
    assert not left, "the benchmark left files behind"


@pytest.mark.slow
def test_query_chunk_benchmark_runs_small(tmp_path):
    """Every slice size runs, the default among them, each with its time and memory."""
    result = run_script(
        SCRIPTS / "bench_query_chunk.py",
        "--models",
        "distmult",
        "--batch-size",
        "256",
        "--negatives",
        "16384",
        "--dim",
        "8",
        "--repeats",
        "1",
        "--json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["chunk"] for r in found] == [512, 128, 124, 62]  # all 512 queries; 2,097,152 // 16,896 = 124
    assert found[0]["ratio"] == 1.0 and all(r["ms"] > 0 and r["peak_mib"] > 0 for r in found)
    assert "124 at a time (default)" in result.stdout


@pytest.mark.slow
def test_transe_defaults_study_runs_small(tmp_path):
    done = run_script(
        SCRIPTS / "transe_defaults.py",
        "--root",
        tmp_path,
        "--graphs",
        "gen-dense",
        "--variants",
        "base,L1",
        "--set",
        "train.max_steps=3",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| base") or line.startswith("| L1")]
    assert len(rows) == 2 and all(0 < float(row.split("|")[2]) < 1 for row in rows)
    assert "1.000" in "".join(rows)  # the better variant is the best on its one graph
    wrong = run_script(SCRIPTS / "transe_defaults.py", "--root", tmp_path, "--variants", "bogus")
    assert wrong.returncode != 0 and "unknown graph or variant: bogus" in wrong.stderr


@pytest.mark.slow
def test_page_writes_benchmark_runs_small(tmp_path):
    """Every regime is measured on its own table, counted row by row, and nothing is left."""
    result = run_script(
        SCRIPTS / "bench_page_writes.py",
        "--dir",
        tmp_path,
        "--rows",
        "50000",
        "--steps",
        "3",
        "--batch",
        "512",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for regime in ("fresh", "reopened", "large folios"):
        line = next(line for line in lines if line.strip().startswith(f"{regime}:"))
        updates = int(re.search(r"for ([\d,]+) row updates", line).group(1).replace(",", ""))
        assert 3 * 490 <= updates <= 3 * 512  # 3 steps of 512 uniform draws, repeats counted once
    assert "large folios / fresh" in result.stdout
    assert not list(tmp_path.iterdir()), "the benchmark left its tables behind"


@pytest.mark.slow
def test_long_run_benchmark_checkpoints_between_whole_minutes(tmp_path):
    """Each 'minute' (1 s here) is a whole window of stepping: a checkpoint falls between two
    of them, never inside one, and is reported apart with its bytes; the batches-only kind
    times the making of batches alone."""
    result = run_script(
        SCRIPTS / "bench_long_run.py",
        *("--rows", "20000", "--dim", "8", "--lookups", "4096", "--distribution", "power"),
        *("--minutes", "0.1", "--minute-seconds", "1", "--checkpoint-minutes", "0.05"),
        *("--only", "dsa", "--only", "batches", "--state-dir", tmp_path),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    runs = {r["kind"]: r for r in map(json.loads, [line for line in result.stdout.splitlines() if line[:1] == "{"])}
    dsa, batches = runs["dsa"], runs["batches"]
    assert len(dsa["minutes"]) == len(batches["minutes"]) == 6
    for minutes in (dsa["minutes"], batches["minutes"]):
        assert all(m["steps"] > 0 for m in minutes)
        # a window ends once its length has passed; the last is what is left of the 6 s (0.9 s
        # once the others' overshoot is taken off, as reported to 0.1 s)
        assert all(m["seconds"] >= 1.0 for m in minutes[:-1]) and sum(m["seconds"] for m in minutes) >= 5.9
    # No wall-clock upper bound (a busy machine stretches any window): the checkpoint falls after
    # the 3rd whole window (--checkpoint-minutes 0.05 = 3 s = 3 windows), at the stepping time
    # those windows report, so none of its time is inside one of them.
    before = sum(m["seconds"] for m in dsa["minutes"][:3])
    assert [c["at_min"] for c in dsa["checkpoints"]] == [pytest.approx(before / 60, abs=0.01)]
    checkpoint = dsa["checkpoints"][0]
    assert checkpoint["s"] > 0 and checkpoint["MiB_held"] > 0 and checkpoint["row_files"]
    assert all(m["median_ms"] == m["batch_median_ms"] for m in batches["minutes"])
    assert "the making of batches alone:" in result.stdout and "the step over it:" in result.stdout
    assert not list(tmp_path.iterdir()), "a child left its state behind"


@pytest.mark.slow  # 15 s: two training processes, each importing torch_geometric
def test_bench_peers_runs_ours_and_pyg_and_names_a_missing_peer(tmp_path):
    """One epoch of a small generated graph in a folder named nations, with dsa-train and PyG's
    DistMult; PyKEEN, absent from an empty peers folder, is reported as not installed rather than
    skipped."""
    g = torch.Generator().manual_seed(0)
    folder = tmp_path / "data" / "nations"
    folder.mkdir(parents=True)
    triples = torch.stack(
        [
            torch.randint(0, 20, (300,), generator=g),
            torch.randint(0, 5, (300,), generator=g),
            torch.randint(0, 20, (300,), generator=g),
        ],
        1,
    )
    for split, rows in (("train", triples[:240]), ("valid", triples[240:270]), ("test", triples[270:])):
        (folder / f"{split}.txt").write_text("".join(f"e{h}\tr{r}\te{t}\n" for h, r, t in rows.tolist()))
    result = run_script(
        SCRIPTS / "bench_peers.py",
        *("--graphs", "nations", "--models", "distmult", "--tools", "ours,pyg,pykeen", "--settings", "equal"),
        *("--epochs", "1", "--valid-every", "0", "--data-root", str(tmp_path / "data")),
        *("--peers-home", str(tmp_path / "peers"), "--json", str(tmp_path / "b.json")),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split("|")[4].strip(): line for line in result.stdout.splitlines() if line.startswith("| nations")}
    assert set(rows) == {"ours", "pyg", "pykeen"}, result.stdout
    assert "| not installed |" in rows["pykeen"]
    cells = {c["tool"]: c for c in json.loads((tmp_path / "b.json").read_text())["cells"]}
    assert cells["pykeen"]["status"] == "not installed"
    for tool in ("ours", "pyg"):
        cell = cells[tool]
        assert cell["status"] == "ok", cell.get("tail")
        assert cell["triples_per_s"] > 0 and cell["peak_rss_anon_mib"] > 10 and cell["wall_s"] > 0
        assert 0 < cell["test_mrr"] <= 1 and 0 < cell["test_hits_at_10"] <= 1
        assert cell["result"]["train_triples"] == 240  # one epoch of the training split


@pytest.mark.slow  # about 15 s: four training processes on a generated graph
def test_bench_peers_scale_trains_each_tool_and_refuses_a_table_the_ram_cannot_hold(tmp_path, monkeypatch):
    """Thirty steps of each tool on a 3,000-entity graph; a tool whose tables need more than three
    quarters of the RAM available is reported as not started, never started."""
    result = run_script(
        SCRIPTS / "bench_peers_scale.py",
        *("--entities", "3000", "--steps", "30", "--work", str(tmp_path), "--json", str(tmp_path / "s.json")),
        *("--peers-home", str(tmp_path / "peers")),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = {r["tool"]: r for r in json.loads((tmp_path / "s.json").read_text())["rows"]}
    assert set(rows) == {"ours", "ours-disk", "pyg", "pyg-sparse", "pykeen"}
    assert rows.pop("pykeen")["status"] == "not installed"  # an empty peers folder: named, not skipped
    for tool, row in rows.items():
        assert row["status"] == "ok", (tool, row.get("tail"))
        assert row["triples_per_s"] > 0 and row["peak_rss_anon_mib"] > 10, row
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]  # graphs and runs removed (no peers folder made)

    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_peers_scale

    # 19.1 GiB of 24 available: it would fit, but not within three quarters (18 GiB)
    monkeypatch.setattr(bench_peers_scale, "available_bytes", lambda: 24 * bench_peers_scale.GiB)
    refused = bench_peers_scale.run_tool("pyg", tmp_path / "never-read", 10**7, argparse.Namespace(dim=128))
    assert refused["status"].startswith("not started: its tables need 19.1 GiB of RAM, 24.0 GiB available")


@pytest.mark.slow  # about 20 s: two training processes on the karate club
def test_bench_node2vec_peers_probes_our_run_and_names_a_missing_peer(tmp_path):
    result = run_script(
        SCRIPTS / "bench_node2vec_peers.py",
        *("--recipe", "karate-node2vec", "--set", "train.epochs=5", "--repeats", "2", "--threads", "1"),
        *("--peers-home", str(tmp_path / "peers"), "--json", str(tmp_path / "n.json")),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    runs = json.loads((tmp_path / "n.json").read_text())["runs"]
    ours = [r for r in runs if r["tool"] == "ours"]
    assert [r["status"] for r in ours] == ["ok", "ok"]
    for r in ours:
        assert 0 <= r["test"] <= 1 and r["train_s"] > 0 and r["peak_rss_anon_mib"] > 10, r
    assert {r["status"] for r in runs if r["tool"] == "pecanpy"} == {"not installed"}  # named, not skipped
    assert "| pecanpy | not installed |" in result.stdout


def test_profile_step_times_the_window_and_lists_its_operators(tmp_path):
    result = run_script(
        SCRIPTS / "profile_step.py",
        "quickstart",
        "--skip",
        "2",
        "--steps",
        "3",
        "--rows",
        "5",
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"^3 steps after 2: \d+\.\d\d ms/step \(profiled\)$", result.stdout, re.M), result.stdout
    assert "Self CPU time total" in result.stdout and result.stdout.count("aten::") >= 3
    assert not list(tmp_path.iterdir()), "the profiled run left its folder behind"


def test_same_behaviour_compares_what_training_computed_not_what_it_measured():
    sys.path.insert(0, str(SCRIPTS))
    try:
        from same_behaviour import first_difference
    finally:
        sys.path.remove(str(SCRIPTS))
    before = [
        {"kind": "train", "step": 20, "loss": 0.5, "lr": 0.01, "items_per_s": 100.0},
        {"kind": "eval", "split": "valid", "seconds": 1.2, "both": {"mrr": 0.3, "queries": 10}},
        {"kind": "summary", "peak_rss_mib": 300.0, "steps": 40, "epochs": [{"epoch": 1, "seconds": 3.0}]},
    ]
    measured_again = [
        {**before[0], "items_per_s": 90.0},
        {**before[1], "seconds": 2.5},
        {**before[2], "peak_rss_mib": 310.0, "epochs": [{"epoch": 1, "seconds": 3.5}]},
    ]
    assert first_difference(before, measured_again) is None
    other_loss = [{**before[0], "loss": 0.5000001}, *measured_again[1:]]
    assert first_difference(before, other_loss) == "line 1 (train): loss"
    other_mrr = [measured_again[0], {**before[1], "both": {"mrr": 0.31, "queries": 10}}, before[2]]
    assert first_difference(before, other_mrr) == "line 2 (eval): both"
    assert first_difference(before, before[:2]) == "3 lines before, 2 after"


@pytest.mark.slow
def test_throughput_benchmark_overrides_one_optimizer_only(tmp_path):
    """``--dsa-set`` reaches DiskSparseAdam's run alone: a disk table, which SparseAdam's run
    would refuse, trains beside SparseAdam's table in RAM."""
    result = run_script(
        SCRIPTS / "bench_throughput.py",
        SCRIPTS.parent / "recipes" / "quickstart.yaml",
        *("--steps", "2", "--warmup", "1", "--repeats", "1", "--dir", tmp_path, "--json"),
        *("--set", "model.embedding_storage=memory", "--dsa-set", "model.embedding_storage=disk"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    setting = json.loads(result.stdout)["setting"]
    assert setting["overrides"] == ["model.embedding_storage=memory"]
    assert setting["dsa_overrides"] == ["model.embedding_storage=disk"]
    assert not list(tmp_path.iterdir()), "a child left its run folder behind"
