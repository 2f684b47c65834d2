"""The optional smaller optimizer state: m in bfloat16, v one value per row.

These are not SparseAdam any more, so the reference is a dense Adam written out here: full
tables of m and v, updated only at the touched rows, m rounded to bfloat16 after each step,
v averaged over the row's elements for the row-wise variant.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dsa_train import DiskEmbedding, DiskSparseAdam, StateError
from dsa_train.storage.inspect import StateInspector

ROWS, DIM, LR, BETAS, EPS = 200, 16, 0.01, (0.9, 0.999), 1e-8


class ReferenceAdam:
    """Adam on a dense copy of the table, touching only the rows with a gradient."""

    def __init__(self, weight: torch.Tensor, *, bf16_m: bool, row_v: bool) -> None:
        self.weight = weight.clone()
        self.m = torch.zeros_like(weight)
        self.v = torch.zeros(ROWS, 1) if row_v else torch.zeros_like(weight)
        self.bf16_m, self.row_v, self.t = bf16_m, row_v, 0

    def step(self, lookups: torch.Tensor, grads: torch.Tensor) -> None:
        self.t += 1
        g = torch.zeros_like(self.weight).index_add_(0, lookups, grads)
        rows = torch.unique(lookups)
        g = g[rows]
        m = self.m[rows] + (1 - BETAS[0]) * (g - self.m[rows])
        squared = (g * g).mean(1, keepdim=True) if self.row_v else g * g
        v = self.v[rows] + (1 - BETAS[1]) * (squared - self.v[rows])
        step_size = LR * (1 - BETAS[1] ** self.t) ** 0.5 / (1 - BETAS[0] ** self.t)
        self.weight[rows] -= step_size * m / (v.sqrt() + EPS)
        self.m[rows] = m.bfloat16().float() if self.bf16_m else m
        self.v[rows] = v


@pytest.mark.parametrize(("first", "second"), [("bfloat16", "full"), ("full", "row"), ("bfloat16", "row")])
def test_smaller_state_follows_its_reference(tmp_path, first, second):
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    reference = ReferenceAdam(emb.weight.detach(), bf16_m=first == "bfloat16", row_v=second == "row")
    opt = DiskSparseAdam(
        emb.named_parameters(),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        state_dir=tmp_path / "s",
        first_moment=first,
        second_moment=second,
    )
    for step in range(50):
        lookups = torch.randint(0, ROWS if step % 2 else 30, (128,))
        opt.zero_grad()
        out = emb(lookups)
        (out**2).sum().backward()
        opt.step()
        reference.step(lookups, 2 * out.detach())
        torch.testing.assert_close(emb.weight.detach(), reference.weight, rtol=1e-5, atol=1e-7)
    opt.flush()
    # What is on disk is the compact state: m (rounded) and v, readable by inspect-state.
    m, v = StateInspector(tmp_path / "s").read_rows("weight", list(range(ROWS)))
    torch.testing.assert_close(torch.tensor(m).float(), reference.m, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(v).float(), reference.v.expand(ROWS, DIM), rtol=1e-6, atol=0)
    opt.close()


def test_smaller_state_takes_less_disk_and_is_recorded(tmp_path):
    sizes = {}
    for first, second in (("full", "full"), ("bfloat16", "full"), ("full", "row"), ("bfloat16", "row")):
        emb = nn.Embedding(ROWS, DIM, sparse=True)
        state = tmp_path / f"{first}-{second}"
        with DiskSparseAdam(emb.named_parameters(), state_dir=state, first_moment=first, second_moment=second):
            pass
        entry = json.loads((state / "manifest.json").read_text())["params"]["weight"]
        sizes[(first, second)] = entry["row_bytes"]
        # Reopened with another setting, the state is refused, not misread.
        other = "row" if second == "full" else "full"
        with pytest.raises(StateError, match="layout"):
            DiskSparseAdam(emb.named_parameters(), state_dir=state, first_moment=first, second_moment=other)
    assert sizes == {
        ("full", "full"): 2 * DIM * 4,
        ("bfloat16", "full"): DIM * 2 + DIM * 4,
        ("full", "row"): DIM * 4 + 8,  # 4 bytes of v, padded to 8
        ("bfloat16", "row"): DIM * 2 + 8,
    }


def test_smaller_state_is_refused_for_disk_tables_and_bad_values(tmp_path):
    disk = DiskEmbedding(ROWS, DIM, path=tmp_path / "t.table")
    with pytest.raises(ValueError, match="full-precision moments"):
        DiskSparseAdam(disk.parameters(), state_dir=tmp_path / "s", first_moment="bfloat16")
    with pytest.raises(ValueError, match="Invalid first_moment"):
        DiskSparseAdam(disk.parameters(), state_dir=tmp_path / "s", first_moment="fp8")
    with pytest.raises(ValueError, match="Invalid second_moment"):
        DiskSparseAdam(disk.parameters(), state_dir=tmp_path / "s", second_moment="column")
