"""Argument and gradient errors: the same type and wording as torch.optim.SparseAdam."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from dsa_train import DiskSparseAdam, StateError

BAD_HYPERPARAMETERS = [
    {"lr": -1.0},
    {"lr": 0.0},
    {"lr": torch.tensor([0.1, 0.2])},
    {"eps": 0.0},
    {"eps": -1e-8},
    {"betas": (1.0, 0.999)},
    {"betas": (-0.1, 0.999)},
    {"betas": (0.9, 1.0)},
]


@pytest.mark.parametrize("kwargs", BAD_HYPERPARAMETERS, ids=repr)
def test_invalid_hyperparameters_match_torch(state_dir, kwargs):
    emb = nn.Embedding(4, 2, sparse=True)
    with pytest.raises(Exception) as reference:
        torch.optim.SparseAdam(emb.parameters(), **kwargs)
    with pytest.raises(type(reference.value), match=f"^{re.escape(str(reference.value))}$"):
        DiskSparseAdam(emb.parameters(), state_dir=state_dir, **kwargs)
    assert not state_dir.exists(), "a rejected optimizer must not create its state directory"


PARAMS_TORCH_REJECTS = [
    ("sparse", lambda: nn.Parameter(torch.randn(4, 2).to_sparse())),
    ("complex", lambda: nn.Parameter(torch.randn(4, 2, dtype=torch.complex64))),
]


@pytest.mark.parametrize("kind,make", PARAMS_TORCH_REJECTS, ids=[k for k, _ in PARAMS_TORCH_REJECTS])
def test_invalid_parameters_match_torch(state_dir, kind, make):
    good = nn.Parameter(torch.randn(3, 2))
    params = [good, make()]
    with pytest.raises(ValueError) as reference:
        torch.optim.SparseAdam(params)
    with pytest.raises(ValueError, match=f"^{re.escape(str(reference.value))}$"):
        DiskSparseAdam(params, state_dir=state_dir)


@pytest.mark.parametrize(
    "param",
    [torch.zeros(4, 2, dtype=torch.int64), torch.tensor(1.0, requires_grad=True)],
    ids=["integer", "zero-dim"],
)
def test_parameters_without_rows_are_rejected(state_dir, param):
    with pytest.raises(ValueError, match=r"Params at indices \[0, 0\].*at least one dimension"):
        DiskSparseAdam([param], state_dir=state_dir)


def torch_error(param, call) -> tuple[type, str]:
    """The exception type and message torch raises for ``call(param)`` (the reference)."""
    try:
        call(param)
    except Exception as e:
        return type(e), str(e)
    raise AssertionError("torch raised nothing")


def test_dense_gradient_raises_like_torch_and_changes_nothing(state_dir):
    emb = nn.Embedding(5, 3, sparse=True)
    dense = nn.Embedding(5, 3)  # sparse=False: dense gradient
    with DiskSparseAdam([emb.weight, dense.weight], state_dir=state_dir) as opt:
        emb(torch.tensor([1])).sum().backward()
        dense(torch.tensor([1])).sum().backward()
        before = emb.weight.detach().clone()
        with pytest.raises(RuntimeError) as ours:
            opt.step()
        assert str(ours.value) == (
            torch_error(dense.weight, lambda p: torch.optim.SparseAdam([p]).step())[1]
            + " (DiskSparseAdam parameter 'param1' got a dense gradient; build its embedding with sparse=True)"
        )
        # Checked before anything moves: the sparse parameter was not stepped either.
        assert torch.equal(emb.weight, before)
        assert "step" not in opt.state[emb.weight]


def test_gradient_with_two_sparse_dims_is_rejected(state_dir):
    w = nn.Parameter(torch.randn(6, 3))
    with DiskSparseAdam([w], state_dir=state_dir) as opt:
        w.grad = torch.randn(6, 3).to_sparse()  # sparse_dim 2: element-wise, not row-wise
        with pytest.raises(RuntimeError, match="needs one sparse dimension"):
            opt.step()


def test_step_after_close_is_a_clear_error(state_dir):
    emb = nn.Embedding(5, 3, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_dir=state_dir)
    opt.close()
    opt.close()  # idempotent
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(StateError, match="closed"):
        opt.step()


def test_colliding_sanitised_names_are_rejected(state_dir):
    a, b = nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"'a b' and 'a/b' both map to the file name 'a_b.rows'"):
        DiskSparseAdam([("a b", a), ("a/b", b)], state_dir=state_dir)
    assert not state_dir.exists()


def test_gradient_rows_out_of_range_are_refused_before_any_write(state_dir):
    a, b = nn.Parameter(torch.randn(6, 3)), nn.Parameter(torch.randn(6, 3))
    with DiskSparseAdam([a, b], state_dir=state_dir) as opt:
        a.grad = torch.sparse_coo_tensor([[1]], torch.ones(1, 3), (6, 3))
        b.grad = torch.sparse_coo_tensor([[2, 6]], torch.ones(2, 3), (6, 3), check_invariants=False)
        before = a.detach().clone()
        with pytest.raises(IndexError, match=r"'param1' has 6 rows, but its sparse gradient touches rows 2 to 6"):
            opt.step()
        assert torch.equal(a, before) and "step" not in opt.state[a]


def test_pickling_and_copying_are_refused_clearly(state_dir):
    import copy
    import pickle

    with DiskSparseAdam([nn.Parameter(torch.randn(6, 3))], state_dir=state_dir) as opt:
        for attempt in (pickle.dumps, copy.deepcopy):
            with pytest.raises(TypeError, match="cannot be pickled or copied.*state_dict"):
                attempt(opt)
