#!/usr/bin/env python
"""Training a KGE recipe over N processes (torchrun, the entity table sharded by rows): step
time, the bytes each rank exchanges per step, each rank's memory and optimizer state, and an
extrapolation of the per-step traffic to more ranks and a bigger table (issue 14's proof).

For each N of ``--nproc`` (default 1,2) the script runs ``python -m dsa_train run RECIPE
--nproc N`` (torchrun --standalone's launcher: gloo on 127.0.0.1 on the CPU) with
``OMP_NUM_THREADS=--threads`` (default 1) in every rank, into a fresh run folder under a
temporary directory that is removed at the end, whatever happens. The recipe runs
``--max-steps`` steps with ``train.log_every`` = ``--max-steps``, ``eval.final_splits=[]`` and
``train.final_checkpoint=false`` (``--set`` overrides come after these and win; the exchange
counters count training traffic only, and evaluation and checkpoints would only add time).
The figures come from the ranks' own records, ``<run>/ranks/<rank>-of-<world>/metrics.jsonl``:

* step time: the ``summary`` record's ``seconds`` (the training loop alone: no process start,
  no dataset mapping, no table initialisation, no evaluation, no checkpoint) divided by its
  steps, for the slowest rank. A run stopped by ``max_steps`` inside its first epoch logs no
  ``epoch`` record, so there is no per-step median to take: this is a mean, cold start
  included. The job's wall time (launch to exit) and CPU time (every rank, setup included)
  are shown beside it, and the last logged loss of every rank (bit-equal for every N with the
  same ``distributed.slices``, docs/distributed.md).
* bytes per step: each rank's ``exchange`` record (``sent_bytes`` / ``received_bytes``: ids,
  rows, gradient rows and the relations' gathered gradient rows, to and from *other* ranks)
  divided by its steps.
* memory: each rank's peak RSS (and its anonymous part) from ``summary``; its rows, its entity
  table (rows x dim x 4 bytes) and the size of its optimizer state file from the state's
  ``manifest.json``; the state's blocks allocated on disk (``optimizer_state_on_disk_mib``:
  only the pages of rows touched so far).

The traffic model reads what ``dsa_train/train/sharded_kge.py`` and
``dsa_train/distributed/exchange.py`` send, per occurrence (duplicates are not merged):
the step's candidate set C (``negatives``, plus the batch's 2n answers with
``train.batch_negatives``) and the anchors and answers of a rank's slices are fetched (an 8-byte
id out, a 4*dim-byte row back); every slice's gradient rows, C's included, go to their owners
(the id again, 8 bytes, then the row, 4*dim bytes, and its 8-byte position in the batch). A
lookup's owner is a uniformly random rank (the seeded permutation), so the share 1/N stays local.
The relation table's gradient rows are all-gathered besides (``gather_everywhere``: every rank's
block padded to the longest rank's count of relation lookups, 4*relation_dim bytes and 16 bytes of
keys a row, to every other rank); the exchange counters include that too. Not counted, and left
out of the model: the split sizes and counts (8 bytes a rank) and the loss all_reduce (8 bytes a
slice).

    python scripts/bench_distributed.py
    python scripts/bench_distributed.py --max-steps 20 --json /tmp/distributed.json
    python scripts/bench_distributed.py --recipe recipes/quickstart.yaml --max-steps 100 --set train.log_every=10
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
LINK_GBIT = 10.0  # the link the extrapolation assumes, in Gb/s, full duplex


# -- one job -------------------------------------------------------------------------------------
def run_job(recipe: Path, nproc: int, overrides: list[str], *, threads: int, folder: Path, timeout: float) -> dict:
    """Train ``recipe`` over ``nproc`` ranks into ``folder/n<nproc>`` and read back each rank's
    records; the run folder is left for the caller's temporary directory to remove."""
    run = folder / f"n{nproc}"
    log = folder / f"n{nproc}.log"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "dsa_train", "run", str(recipe), "--nproc", str(nproc), "-o", str(run)]
    command += [f"--set={o}" for o in overrides]
    load = os.getloadavg()[0]
    busy_before = busy_cpu_s()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    with open(log, "w") as out:
        job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            code = job.wait(timeout=timeout)
        except BaseException:  # a timeout, ^C or SIGTERM: stop torchrun and its ranks (its own process group)
            _stop(job)
            raise
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_after = busy_cpu_s()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if code != 0:
        raise RuntimeError(f"the N={nproc} job failed (exit {code}):\n{log.read_text(errors='replace')[-4000:]}")
    ranks = [read_rank(run / "ranks" / f"{rank:05d}-of-{nproc:05d}", rank) for rank in range(nproc)]
    step_s = max(r["seconds"] / r["steps"] for r in ranks)
    return {
        "nproc": nproc,
        "threads_per_rank": threads,
        "load_before": round(load, 2),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "others_cpu_s": round(max(0.0, busy_after - busy_before - cpu), 1)
        if busy_before is not None and busy_after is not None
        else None,
        "steps": ranks[0]["steps"],
        "train_s": max(r["seconds"] for r in ranks),
        "step_s": step_s,
        "ranks": ranks,
    }


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has been busy (Linux /proc/stat); with the job's own CPU
    time it tells how much other processes took from the cores during the job."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _stop(job: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL to the job's process group (torchrun and the ranks it started)."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(job.pid, sig)
        except ProcessLookupError:
            return
        try:
            job.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_rank(folder: Path, rank: int) -> dict:
    """One rank's figures from its metrics.jsonl and its optimizer state's manifest."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = {r["kind"]: r for r in records}
    summary, exchange = last.get("summary"), last.get("exchange")
    if summary is None or exchange is None:
        raise RuntimeError(f"{folder / 'metrics.jsonl'} has no summary or exchange record: {sorted(last)}")
    steps = exchange["steps"]
    rank_figures = {
        "rank": rank,
        "steps": steps,
        "seconds": summary["seconds"],
        "epoch_records": sum(r["kind"] == "epoch" for r in records),
        "sent_bytes": exchange["sent_bytes"],
        "received_bytes": exchange["received_bytes"],
        "sent_per_step": exchange["sent_bytes"] / steps,
        "received_per_step": exchange["received_bytes"] / steps,
        "peak_rss_mib": summary["peak_rss_mib"],
        "peak_rss_anon_mib": summary.get("peak_rss_anon_mib"),
        "state_on_disk_mib": summary["optimizer_state_on_disk_mib"],
        "last_loss": next((r["loss"] for r in reversed(records) if r["kind"] == "train"), None),
        "rows": None,
        "dim": None,
        "relation_dim": None,
        "table_mib": None,
        "state_file_mib": None,
    }
    for manifest in folder.rglob("manifest.json"):  # the DiskSparseAdam state (absent with another optimizer)
        state = json.loads(manifest.read_text())
        if state.get("format") != "dsa-train/disk-sparse-adam-state":
            continue
        params = state["params"]
        node = params.get("node_emb.weight")
        if node:
            rows, dim = node["shape"]
            rank_figures.update(
                rows=rows,
                dim=dim,
                table_mib=rows * dim * 4 / MiB,
                state_file_mib=(manifest.parent / node["file"]).stat().st_size / MiB,
            )
        if "rel_emb.weight" in params:
            rank_figures["relation_dim"] = params["rel_emb.weight"]["shape"][1]
    return rank_figures


# -- the traffic model ---------------------------------------------------------------------------
def traffic_model(n: int, k: int, slices: int, world: int, dim: int, relation_dim: int) -> dict:
    """Expected bytes each rank sends and receives per step (see the module docstring): slice
    ``m`` of the ``n`` triples is computed by rank ``m % world``; every lookup's owner is
    uniformly random. Returns the busiest rank's figures and how many ranks compute."""
    row, rel_row = 4 * dim, 4 * relation_dim
    bounds = [n * m // slices for m in range(slices + 1)]
    size = [bounds[m + 1] - bounds[m] for m in range(slices)]
    fetch, push, relations = [], [], []
    for r in range(world):
        mine = [m for m in range(slices) if m % world == r and size[m] > 0]
        fetch.append((k if mine else 0) + sum(4 * size[m] for m in mine))  # C once, then anchors and answers
        push.append(sum(k + 4 * size[m] for m in mine))  # every slice's gradient rows, C's included
        relations.append(sum(2 * size[m] for m in mine))
    away = 1 - 1 / world
    total_fetch, total_push = sum(fetch), sum(push)
    sent = [away * (fetch[r] * 8 + push[r] * (16 + row)) + (total_fetch - fetch[r]) / world * row for r in range(world)]
    received = [
        away * fetch[r] * row + ((total_fetch - fetch[r]) * 8 + (total_push - push[r]) * (16 + row)) / world
        for r in range(world)
    ]
    relation = (world - 1) * max(relations) * (rel_row + 16)  # all_gather: every rank's padded block to every other
    return {
        "world": world,
        "slices": slices,
        "computing_ranks": sum(1 for f in fetch if f),
        "lookups_fetched": max(fetch),
        "lookups_pushed": max(push),
        "entity_sent": max(sent),
        "entity_received": max(received),
        "relation_gather": relation,
        "sent": max(sent) + relation,  # what the exchange counters count
        "received": max(received) + relation,
        "busiest": max(max(a, b) for a, b in zip(sent, received)) + relation,
    }


def link_ms(nbytes: float, gbit: float = LINK_GBIT) -> float:
    return nbytes * 8 / (gbit * 1e9) * 1e3


FORMULA = (
    "every rank computes s = S/N slices of q = n/S triples (N <= S); K = negatives + 2n (batch_negatives) or negatives; r = 4*dim\n"
    "  entity rows, sent = received per rank per step = (1 - 1/N) * [ (K + 4*s*q)*(8 + r) + s*(K + 4*q)*(16 + r) ]\n"
    "      fetch: C once and the slices' anchors and answers: an 8-byte id out, an r-byte row back\n"
    "      push:  each slice's gradient rows, C's included: the id again (8), the row (r), its position (8)\n"
    "  + relation all_gather = (N - 1) * 2*s*q * (4*relation_dim + 16) each way (padded to the busiest rank's 2*s*q)\n"
    "  = what the exchange record counts (sent_bytes, received_bytes) per step\n"
    "  the table's row count does not appear: only the share 1/N that stays local depends on N;\n"
    "  for N > S only S ranks compute and the model takes the busiest rank (the exact sums in traffic_model)"
)


# -- printing ------------------------------------------------------------------------------------
def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.2f} MB"


def _or_dash(value: float | None, spec: str) -> str:
    width = spec.split(".")[0]
    return format(value, spec) if value is not None else format("-", f">{width}")


def show(runs: list[dict], base: dict) -> None:
    print(
        f"\n{'N':>3} {'step s':>8} {'triples/s':>10} {'speed vs N=' + str(base['nproc']):>15} {'train s':>8} {'job wall s':>10} {'job CPU s':>9} {'others CPU s':>12} {'load':>5}"
    )
    for job in runs:
        print(
            f"{job['nproc']:>3} {job['step_s']:8.3f} {job['items_per_s']:10,.0f} {job['speed_vs_base']:14.2f}x {job['train_s']:8.1f} "
            f"{job['wall_s']:10.1f} {job['cpu_s']:9.1f} {_or_dash(job['others_cpu_s'], '12.1f')} {job['load_before']:5.2f}"
        )
    print(
        "(job CPU: every process of the job, setup included; others CPU: what other processes of the machine took meanwhile; "
        "load: the 1-minute load average before the job)"
    )
    print(
        f"\n{'N':>3} {'rank':>4} {'sent/step':>12} {'recv/step':>12} {'rows':>12} {'table MiB':>10} {'state file MiB':>14} "
        f"{'state on disk':>13} {'peak RSS':>9} {'anon RSS':>9}"
    )
    for job in runs:
        for r in job["ranks"]:
            rows = f"{r['rows']:,}" if r["rows"] is not None else "-"
            table = f"{r['table_mib']:,.0f}" if r["table_mib"] is not None else "-"
            state = f"{r['state_file_mib']:,.0f}" if r["state_file_mib"] is not None else "-"
            anon = f"{r['peak_rss_anon_mib']:,.0f}" if r["peak_rss_anon_mib"] is not None else "-"
            print(
                f"{job['nproc']:>3} {r['rank']:>4} {mb(r['sent_per_step']):>12} {mb(r['received_per_step']):>12} {rows:>12} {table:>10} "
                f"{state:>14} {r['state_on_disk_mib']:>13,.0f} {r['peak_rss_mib']:>9,.0f} {anon:>9}"
            )
    print(
        "(MiB unless said; state file: the rank's DiskSparseAdam moments file, rows x 2 moments x dim x 4 bytes; "
        "state on disk: its blocks allocated so far, the pages of rows touched)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "synthetic-10m.yaml")
    parser.add_argument("--nproc", default="1,2", help="comma-separated numbers of ranks to run (default 1,2)")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=40,
        help="steps per run (default 40: synthetic-10m takes under a minute a run on 2 cores)",
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank (default 1)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="recipe override key=value (after the script's own)",
    )
    parser.add_argument(
        "--extrapolate", default="8,64", help="numbers of ranks for the paper extrapolation (default 8,64)"
    )
    parser.add_argument("--rows", type=float, default=1e9, help="table rows of the extrapolation (default 1e9)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one job may take before it is stopped")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the temporary run folders go (default: the system's)"
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="also write every figure to PATH as JSON"
    )
    args = parser.parse_args()
    nprocs = [int(x) for x in args.nproc.split(",") if x.strip()]
    wide = [int(x) for x in args.extrapolate.split(",") if x.strip()]
    if not nprocs or min(nprocs) < 1 or args.max_steps < 1 or args.threads < 1 or (wide and min(wide) < 1):
        parser.error("--nproc and --extrapolate take positive integers; --max-steps and --threads must be at least 1")

    sys.path.insert(0, str(REPO))
    from dsa_train.recipe.find import find_recipe
    from dsa_train.recipe import load_recipe  # only the recipe: torch stays in the ranks

    overrides = [
        f"train.max_steps={args.max_steps}",
        f"train.log_every={args.max_steps}",
        "eval.final_splits=[]",
        "train.final_checkpoint=false",
        *args.overrides,
    ]
    args.recipe = find_recipe(args.recipe)  # a path, or a shipped recipe's name
    recipe = load_recipe(args.recipe, overrides)
    cfg = recipe.train
    n, slices, dim = cfg.batch_size, recipe.distributed.slices, recipe.model.dim
    k = cfg.negatives + (2 * n if cfg.batch_negatives else 0)
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    print(
        f"{recipe.name}: {recipe.dataset.synthetic.entities if recipe.dataset.kind == 'synthetic' else '?'} entities, {recipe.model.kind} dim {dim}, "
        f"batch {n}, negatives {cfg.negatives} (+{2 * n if cfg.batch_negatives else 0} batch answers: |C| = {k}), slices {slices}; "
        f"{args.max_steps} steps a run, OMP_NUM_THREADS={args.threads} per rank, {os.cpu_count()} CPUs, commit {commit}",
        flush=True,
    )
    print(
        "step s = the summary record's training-loop seconds / steps, slowest rank (a mean over the steps, cold start included; "
        "no process start, setup, evaluation or checkpoint)",
        flush=True,
    )

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the job and removes the folder
    tmp = Path(tempfile.mkdtemp(prefix="dsa-bench-distributed-", dir=args.dir))
    runs = []
    try:
        for nproc in nprocs:
            print(f"  N={nproc}: running ...", end="", flush=True)
            job = run_job(
                args.recipe.resolve(), nproc, overrides, threads=args.threads, folder=tmp, timeout=args.timeout
            )
            print(f" {job['wall_s']:.0f} s", flush=True)
            runs.append(job)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = next((job for job in runs if job["nproc"] == 1), runs[0])
    for job in runs:
        job["items_per_s"] = n / job["step_s"]
        job["speed_vs_base"] = base["step_s"] / job["step_s"]
    show(runs, base)
    losses = {job["nproc"]: [r["last_loss"] for r in job["ranks"]] for job in runs}
    flat = [x for values in losses.values() for x in values]
    if flat and None not in flat:
        same = len(set(flat)) == 1
        print(
            f"last logged loss (train record): {'; '.join(f'N={w}: ' + ', '.join(repr(x) for x in v) for w, v in losses.items())} "
            f"-> {'bit-equal for every N and rank' if same else 'DIFFERENT (the same slices should give bit-equal losses)'}"
        )
    relation_dim = next((r["relation_dim"] for job in runs for r in job["ranks"] if r["relation_dim"]), dim)

    # the model against the measured exchange counters
    print(f"\ntraffic model (from sharded_kge.py / exchange.py):\n  {FORMULA}")
    checks = []
    for job in runs:
        if job["nproc"] == 1:
            continue
        model = traffic_model(n, k, slices, job["nproc"], dim, relation_dim)
        sent = statistics.mean(r["sent_per_step"] for r in job["ranks"])
        received = statistics.mean(r["received_per_step"] for r in job["ranks"])
        checks.append(
            {
                "nproc": job["nproc"],
                "measured_sent": sent,
                "measured_received": received,
                "model": model,
                "sent_error": sent / model["sent"] - 1,
                "received_error": received / model["received"] - 1,
            }
        )
    if checks:
        print(
            f"\n{'N':>3} {'measured sent':>14} {'model':>9} {'error':>7} {'measured recv':>14} {'model':>9} {'error':>7}   "
            "(per rank per step, mean over ranks; model = entity rows + relation gather)"
        )
        for c in checks:
            m = c["model"]
            print(
                f"{c['nproc']:>3} {mb(c['measured_sent']):>14} {mb(m['sent']):>9} {c['sent_error']:+7.2%} "
                f"{mb(c['measured_received']):>14} {mb(m['received']):>9} {c['received_error']:+7.2%}   "
                f"(= {mb(m['entity_sent'])} + {mb(m['relation_gather'])})"
            )

    # on paper: more ranks, a bigger table
    paper = []
    anchor = (
        checks[-1] if checks else None
    )  # the widest measured job: the model's figure scaled by its measured / model ratio
    for world in wide:
        for s in sorted({slices, max(slices, world)}):
            m = traffic_model(n, k, s, world, dim, relation_dim)
            table = args.rows * dim * 4 / world
            paper.append(
                {
                    **m,
                    "rows": args.rows,
                    "table_per_rank_bytes": table,
                    "state_per_rank_bytes": 2 * table,
                    "link_ms": link_ms(m["busiest"]),
                }
            )
            if anchor:
                measured = max(anchor["measured_sent"], anchor["measured_received"])
                scaled = measured * m["busiest"] / anchor["model"]["busiest"]
                paper[-1].update(scaled_from_measured=scaled, scaled_link_ms=link_ms(scaled))
    if paper:
        print(
            f"\non paper: a {args.rows:,.0f}-row table, batch {n}, |C| = {k}, dim {dim}; time = the busiest rank's larger direction "
            f"at {LINK_GBIT:g} Gb/s full duplex (bandwidth only: no latency of the ~11 collectives a step)"
        )
        print(
            f"{'N':>3} {'slices':>6} {'computing':>9} {'entity sent':>12} {'entity recv':>12} {'rel. gather':>12} {'per rank':>10} "
            f"{'from measured':>13} {'at 10 Gb/s':>10} {'table/rank':>10} {'Adam/rank':>10}"
        )
        for p in paper:
            scaled = mb(p["scaled_from_measured"]) if "scaled_from_measured" in p else "-"
            print(
                f"{p['world']:>3} {p['slices']:>6} {p['computing_ranks']:>9} {mb(p['entity_sent']):>12} {mb(p['entity_received']):>12} "
                f"{mb(p['relation_gather']):>12} {mb(p['busiest']):>10} {scaled:>13} {p['link_ms']:7.1f} ms "
                f"{p['table_per_rank_bytes'] / 1e9:7.1f} GB {p['state_per_rank_bytes'] / 1e9:7.1f} GB"
            )
        print(
            "  entity sent / recv: the busiest rank's; per rank: the busiest rank's larger direction, relation gather included "
            f"(the model's sent/received_bytes); from measured: the larger direction measured at N={anchor['nproc'] if anchor else '-'} "
            "times the model's ratio; at 10 Gb/s: per rank's time"
        )
        print(f"  measured step time at N={base['nproc']} on this machine: {base['step_s'] * 1e3:,.0f} ms")

    if args.json:
        document = {
            "setting": {
                "recipe": recipe.name,
                "recipe_path": str(args.recipe),
                "overrides": overrides,
                "batch": n,
                "negatives": cfg.negatives,
                "batch_negatives": cfg.batch_negatives,
                "candidates": k,
                "slices": slices,
                "dim": dim,
                "relation_dim": relation_dim,
                "max_steps": args.max_steps,
                "threads_per_rank": args.threads,
                "cpus": os.cpu_count(),
                "commit": commit,
                "step_time": "summary seconds / steps, slowest rank (training loop only, mean with cold start)",
            },
            "runs": runs,
            "losses_bit_equal": len({r["last_loss"] for job in runs for r in job["ranks"]}) == 1,
            "model": {"formula": FORMULA, "check": checks, "extrapolation": paper, "link_gbit": LINK_GBIT},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"\nfigures written to {args.json}")


if __name__ == "__main__":
    main()
