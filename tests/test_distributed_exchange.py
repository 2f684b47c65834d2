"""Row sharding and the row exchange on a gloo group of 2 and 3 processes on 127.0.0.1.

The reference is a single process holding the whole table: rows fetched through the exchange
equal indexing the table, and DiskSparseAdam applied by each owner to the gradient rows pushed
to it leaves every shard (weights and moments) bit-equal to DiskSparseAdam on the whole table
given the batch's gradient summed in batch order (what the exchange defines as exact).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsa_train import DiskSparseAdam
from dsa_train.distributed.exchange import RowExchange, sum_in_batch_order
from dsa_train.distributed.sharding import RowSharding

ROWS, DIM, LOOKUPS, STEPS, SEED = 97, 6, 120, 5, 3


def test_every_row_has_one_owner_and_one_place():
    for world in (1, 2, 3, 4, 7):
        sharding = RowSharding(ROWS, world, SEED)
        owners, local = sharding.locate(torch.arange(ROWS))
        assert sum(sharding.rows_of(r) for r in range(world)) == ROWS
        for rank in range(world):
            mine = torch.sort(local[owners == rank]).values
            assert torch.equal(mine, torch.arange(sharding.rows_of(rank)))  # a dense block of local rows
            assert torch.equal(owners[sharding.ids_of(rank, mine)], torch.full_like(mine, rank))
        ids = torch.randint(0, ROWS, (50,))
        owner, local = sharding.locate(ids)
        assert torch.equal(torch.stack([sharding.ids_of(int(r), x.view(1))[0] for r, x in zip(owner, local)]), ids)


def test_hot_low_ids_spread_over_ranks():
    owners, _ = RowSharding(10_000, 4, SEED).locate(torch.arange(400))  # power-law tables' hot rows
    assert torch.bincount(owners, minlength=4).min() > 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches():
    g = torch.Generator().manual_seed(SEED)
    table = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    steps = [
        (
            torch.randint(0, ROWS // 3, (LOOKUPS,), generator=g),
            torch.randn(LOOKUPS, DIM, generator=g, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]
    return table, steps  # few distinct rows: many duplicates, split over several ranks


def _rank_main(rank: int, world: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        table, steps = _batches()
        sharding = RowSharding(ROWS, world, SEED)
        exchange = RowExchange(sharding)
        mine = sharding.ids_of(rank, torch.arange(sharding.rows_of(rank)))
        shard = torch.nn.Parameter(table[mine].clone())
        with DiskSparseAdam([("shard", shard)], lr=0.05, state_dir=os.path.join(folder, f"rank{rank}")) as opt:
            for step, (ids, grads) in enumerate(steps):
                share = torch.tensor_split(torch.arange(LOOKUPS), world)[rank]  # this rank's slice of the batch
                request = exchange.request(ids[share])
                rows = exchange.fetch(request, shard.detach())
                if step == 0:  # before any update the shards together are the table
                    assert torch.equal(rows, table[ids[share]])
                shard.grad = exchange.push(request, grads[share], share, tuple(shard.shape))
                opt.step()
            opt.flush()
            state = opt._store.files["shard"]
            torch.save(
                {"ids": mine, "weights": shard.detach().clone(), "m": state.m.clone(), "v": state.v.clone()},
                os.path.join(folder, f"out{rank}.pt"),
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world", [2, pytest.param(3, marks=pytest.mark.slow)]
)  # 2: the fast run's one check that processes exchange rows here
def test_sharded_steps_equal_one_process_bit_for_bit(tmp_path, world):
    mp.spawn(_rank_main, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    table, steps = _batches()
    whole = torch.nn.Parameter(table.clone())
    with DiskSparseAdam([("whole", whole)], lr=0.05, state_dir=tmp_path / "single") as opt:
        for ids, grads in steps:
            whole.grad = sum_in_batch_order(ids, grads, (ROWS, DIM))
            opt.step()
        state = opt._store.files["whole"]
        m, v = state.m.clone(), state.v.clone()
    covered = 0
    for rank in range(world):
        out = torch.load(tmp_path / f"out{rank}.pt", weights_only=True)
        w = whole.detach()[out["ids"]]
        assert torch.equal(out["weights"], w), (
            f"rank {rank}: weights differ by {(out['weights'] - w).abs().max()}, m by {(out['m'] - m[out['ids']]).abs().max()}, v by {(out['v'] - v[out['ids']]).abs().max()}; rows {out['ids'][(out['weights'] != w).any(1)].tolist()}"
        )
        assert torch.equal(out["m"], m[out["ids"]]) and torch.equal(out["v"], v[out["ids"]]), (
            f"rank {rank}: moments differ"
        )
        covered += len(out["ids"])
    assert covered == ROWS


def test_batch_order_sums_duplicates_first_to_last():
    rows = torch.tensor([4, 1, 4, 4, 1])
    values = torch.tensor([[1e16], [1.0], [1.0], [-1e16], [2.0]], dtype=torch.float64)
    grad = sum_in_batch_order(rows, values, (6, 1))
    assert grad.is_coalesced() and grad._indices().tolist() == [[1, 4]]
    # row 4: (1e16 + 1) + -1e16 = 0 in float64 (1 is lost), not 1e16 + -1e16 + 1 = 1
    assert grad._values().flatten().tolist() == [3.0, 0.0]


def test_a_rank_that_owns_none_of_the_lookups_gets_an_empty_gradient():
    grad = sum_in_batch_order(torch.empty(0, dtype=torch.int64), torch.empty(0, 3), (5, 3))
    assert grad._nnz() == 0 and grad.shape == (5, 3)
