"""node2vec in partition order: pools of walk pairs in buckets, trained buffer state by
buffer state; checked against the graph, against random order, and across a failed step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dsa_train.errors import ConfigError
from dsa_train.recipe import parse_recipe
from dsa_train.runs.run_folder import MetricsLog
from dsa_train.train.node2vec import Node2VecTask
from dsa_train.train.partitioned_node2vec import PartitionedNode2VecTask
from dsa_train.train.tables import TableSite
from dsa_train.train.tasks import make_task

from .test_partitioned import invoke, records  # the CLI, and metrics records without their timings

from .helpers import error_at_step

SMALL = """\
name: small-n2v
dataset:
  kind: synthetic_graph
  graph: {nodes: 1500, communities: 5, average_degree: 6, homophily: 0.9, zipf: 1.0, seed: 0}
model:
  kind: node2vec
  dim: 16
  embedding_storage: disk
  node2vec: {walk_length: 8, context_size: 4, walks_per_node: 1, negatives: 1}
train: {epochs: 3, batch_size: 128, log_every: 4, checkpoint_every: 5, keep_checkpoints: 3,
        order: partitioned, partitions: 4, buffer: 2, pool_pairs: 6000}
optimizer: {kind: dsa, lr: 0.05}
eval: {final_splits: [test]}
"""


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return path


@pytest.mark.parametrize("partitions", [8, 1])
def test_an_epoch_trains_each_start_nodes_edges_once_inside_the_buffer(tmp_path, partitions):
    """Walks of one step with a window of 2: every pair is a walk's first step, so it must be
    an edge of the graph from a start node, and an epoch must start from every node exactly
    once; each batch's pairs and negatives lie in the partitions held for it. With one
    partition too: the task is built directly, as a run never builds it (a run with
    ``partitions: 1`` is random order's task), so the machinery's P = 1 case is checked."""
    recipe = parse_recipe(
        SMALL,
        overrides=[
            "model.node2vec.walk_length=1",
            "model.node2vec.context_size=2",
            "model.node2vec.negatives=3",
            "train.pool_pairs=750",
            "train.batch_size=32",
            f"train.partitions={partitions}",
            "train.buffer=3",  # 2 pools, short states
        ],
    )
    task = PartitionedNode2VecTask(recipe, torch.device("cpu"), TableSite(tmp_path / "tables"))
    graph = task.graph
    edges = set(
        zip(
            *[
                t.tolist()
                for t in (
                    torch.repeat_interleave(torch.arange(graph.num_nodes), graph.degree(torch.arange(graph.num_nodes))),
                    graph.col.long(),
                )
            ]
        )
    )
    isolated = set(torch.nonzero(graph.degree(torch.arange(graph.num_nodes)) == 0).flatten().tolist())
    order = task.epoch_order(7, task.epoch_items())
    starts, size, needs = [], recipe.train.batch_size, []
    upcoming = order.slice(0, size)
    for batch in range(
        -(-graph.num_nodes // size)
    ):  # as the loop does: the next batch prefetched, then this one trained
        picked, upcoming = upcoming, order.slice((batch + 1) * size, (batch + 2) * size)
        if len(upcoming):
            task.prefetch(upcoming)
        positive, negative = task.windows(picked)
        held = set(task.held.current)
        needs.append(held)
        assert len(positive) == len(picked) and len(negative) == 3 * len(picked)
        assert set(task.partitions.partition_of(torch.cat([positive, negative]).flatten()).tolist()) <= held
        assert len(held) <= recipe.train.buffer + 2  # a batch across three states (or pools) at most here
        for u, v in positive.tolist():
            assert (u, v) in edges or (u == v and u in isolated)
        assert torch.equal(negative[:, 0], positive[:, 0].repeat(3))
        starts += positive[:, 0].tolist()
    task.close()
    # What a batch no longer needs is written back before more is read, and the next batch's
    # partitions are read ahead only within C + 1: memory never holds more than C + 1
    # partitions or one batch's (this graph's states are short: some batches span 3).
    capacity = task.held.capacity
    if partitions > 1:
        assert max(len(a | b) for a, b in zip(needs, needs[1:])) > max(
            capacity + 1, max(map(len, needs))
        )  # the case arises
    else:
        assert set().union(*needs) == {0} and task.partitions.partitions == 1
    assert task.held.buffer.stats["peak_partitions"] <= max(capacity + 1, max(map(len, needs)))
    assert sorted(starts) == list(range(graph.num_nodes))
    assert len(task._pools) <= 2  # pools behind the current one are let go


def test_partitioned_node2vec_resumes_after_a_failed_step_exactly(small, tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    first = invoke("run", small, "-o", whole)
    assert first.exit_code == 0, first.stderr
    assert "partition buffer: 2 of 4 partitions of" in first.stdout

    with error_at_step(17):  # in the second epoch, after the checkpoint of step 15
        assert invoke("run", small, "-o", broken).exit_code == 1
    resumed = invoke("run", small, "-o", broken, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    for kind in ("train", "epoch", "eval", "summary"):
        assert records(broken, kind) == records(whole, kind), kind
    table = lambda run: np.fromfile(run / "tables" / "nodes.table", dtype=np.float32, offset=4096)  # noqa: E731
    assert np.array_equal(table(broken), table(whole))
    summary = next(r for r in MetricsLog.read(whole / "metrics.jsonl") if r["kind"] == "summary")
    assert summary["buffer"]["loads"] >= 4 and summary["buffer"]["pool_pairs"] > 0


def test_partitioned_node2vec_learns_as_random_order_does_and_eval_reads_it_by_id(small, tmp_path):
    """The same epochs in random and partition order give probe accuracies within 0.05 (far
    above the 0.2 of 5 classes); `eval` of the partitioned run finds the metrics it ended with
    (a table read by id instead of by slot would score other rows)."""
    accuracy = {}
    for order in ("random", "partitioned"):
        run = tmp_path / order
        done = invoke("run", small, "-o", run, "--set", f"train.order={order}", "--set", "train.epochs=8")
        assert done.exit_code == 0, done.stderr
        accuracy[order] = next(r for r in MetricsLog.read(run / "metrics.jsonl") if r["kind"] == "summary")["final"][
            "test"
        ]["probe"]["accuracy"]
    assert accuracy["random"] > 0.5 and abs(accuracy["partitioned"] - accuracy["random"]) < 0.05, accuracy
    final = next(r for r in MetricsLog.read(tmp_path / "partitioned" / "metrics.jsonl") if r["kind"] == "summary")[
        "final"
    ]
    scored = invoke("eval", tmp_path / "partitioned", "--json")
    assert scored.exit_code == 0, scored.stderr
    assert json.loads(scored.stdout)["metrics"] == final["test"]
    refused = invoke("eval", tmp_path / "partitioned", "--save-ranks", tmp_path / "ranks.tsv")
    assert refused.exit_code != 0 and "'node2vec' has none" in refused.stderr and not (tmp_path / "ranks.tsv").exists()


def test_one_partition_runs_the_random_order_task(tmp_path):
    """node2vec's pools draw their walks from seeds of their own, so partition order with one
    partition is not random order's run; a recipe with ``partitions: 1`` trains random order's
    task instead (docs/partitioned.md#limits). The partitioned machinery at P = 1 is checked
    against the graph above."""
    recipe = parse_recipe(SMALL, overrides=["train.partitions=1"])
    task = make_task(recipe, torch.device("cpu"), TableSite(tmp_path / "tables"))
    assert type(task) is Node2VecTask
    four = make_task(parse_recipe(SMALL), torch.device("cpu"), TableSite(tmp_path / "four"))
    assert type(four) is PartitionedNode2VecTask
    four.close()


def test_partition_order_is_refused_for_sage():
    with pytest.raises(ConfigError, match="'partitioned' trains knowledge-graph models and node2vec, not 'sage'"):
        sage = SMALL.replace("kind: node2vec", "kind: sage").replace(
            "  node2vec: {walk_length: 8, context_size: 4, walks_per_node: 1, negatives: 1}\n", ""
        )
        parse_recipe(sage.replace("  kind: synthetic_graph\n", "  kind: synthetic_graph\n  link_split: [0.05, 0.1]\n"))
