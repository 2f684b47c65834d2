"""``DiskSparseAdam.load_rows``: moments and the step counter set from outside (how a job
resumed at another number of ranks moves each row's state to its new owner).

The reference is the optimizer that produced those moments: a second optimizer given the same
weights, ``m``, ``v`` and step through ``load_rows`` (in two row chunks, out of order) must
then take exactly the same steps, and ``torch.optim.SparseAdam`` continued from the same
point too; a compact state keeps its own rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsa_train import DiskSparseAdam
from dsa_train.storage.inspect import StateInspector
from dsa_train.runs.changed_rows import count_from

ROWS, DIM = 120, 8


def _train(emb: nn.Embedding, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lookups = torch.randint(0, ROWS, (64,), generator=g)
        opt.zero_grad()
        (emb(lookups) ** 2).sum().backward()
        opt.step()


@pytest.mark.parametrize(("first", "second"), [("full", "full"), ("bfloat16", "row")])
def test_loaded_rows_continue_as_the_optimizer_that_made_them(tmp_path, first, second):
    kwargs = dict(lr=0.05, first_moment=first, second_moment=second)
    source = nn.Embedding(ROWS, DIM, sparse=True)
    with DiskSparseAdam(source.named_parameters(), state_dir=tmp_path / "a", **kwargs) as opt:
        _train(source, opt, 7, seed=0)
        opt.flush()
        m, v = (
            torch.tensor(x, dtype=torch.float32)
            for x in StateInspector(tmp_path / "a").read_rows("weight", range(ROWS))
        )
        target = nn.Embedding(ROWS, DIM, sparse=True)
        target.weight.data.copy_(source.weight.detach())
        with DiskSparseAdam(target.named_parameters(), state_dir=tmp_path / "b", **kwargs) as loaded:
            halves = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1)).chunk(2)
            for rows in halves:
                loaded.load_rows(target.weight, rows, m[rows], v[rows], step=7)
            _train(source, opt, 5, seed=2)
            _train(target, loaded, 5, seed=2)
            assert torch.equal(target.weight, source.weight)
            loaded.flush()
            assert loaded.state_dict()["state"][0]["step"] == 12
    if first == "full":  # and SparseAdam given the same m, v and step continues the same way
        reference = nn.Embedding(ROWS, DIM, sparse=True)
        reference.weight.data.copy_(target.weight.detach())
        with DiskSparseAdam(reference.named_parameters(), state_dir=tmp_path / "c", **kwargs) as opt:
            opt.load_rows(reference.weight, torch.arange(ROWS), m, v, step=7)
            torch_ref = nn.Embedding(ROWS, DIM, sparse=True)
            torch_ref.weight.data.copy_(reference.weight.detach())
            sparse_adam = torch.optim.SparseAdam(torch_ref.parameters(), lr=0.05)
            sparse_adam.state[torch_ref.weight] = {"step": 7, "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
            _train(reference, opt, 3, seed=4)
            _train(torch_ref, sparse_adam, 3, seed=4)
            assert torch.equal(reference.weight, torch_ref.weight)


def test_loaded_rows_are_in_the_next_checkpoint_delta(tmp_path):
    """Rows set by load_rows count as written: a checkpoint delta counted from creation has them."""
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    with DiskSparseAdam(emb.named_parameters(), state_dir=tmp_path / "s") as opt:
        changed = count_from(opt, "initial")
        rows = torch.tensor([3, 50, 7])
        opt.load_rows(emb.weight, rows, torch.ones(3, DIM), torch.ones(3, DIM), step=4)
        assert changed.rows(tmp_path / "s" / "weight.rows").tolist() == [3, 7, 50]
