"""CUDA parameters: moments stay on the host, only touched rows cross the bus.

Skipped without a CUDA device (CI has none); run on a GPU machine with ``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dsa_train import DiskSparseAdam

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("maximize", [False, True])
def test_cuda_parity_with_sparse_adam(state_dir, maximize):
    model = nn.Embedding(500, 16, sparse=True).cuda()
    ours_model = copy.deepcopy(model)
    reference = torch.optim.SparseAdam(model.parameters(), lr=0.01, maximize=maximize)
    with DiskSparseAdam(ours_model.parameters(), lr=0.01, maximize=maximize, state_dir=state_dir) as ours:
        for t in range(200):
            g = torch.Generator().manual_seed(t)
            idx = torch.randint(0, 500, (256,), generator=g).cuda()
            target = torch.randn(256, 16, generator=g).cuda()
            for m, opt in ((model, reference), (ours_model, ours)):
                opt.zero_grad()
                (m(idx) * target).sum().backward()
                opt.step()
        assert ours_model.weight.device.type == "cuda"
        assert ours._store.files["param0"].moments.device.type == "cpu"
        torch.testing.assert_close(ours_model.weight, model.weight, rtol=0, atol=1e-5)


def test_cuda_memory_does_not_grow_with_the_table(state_dir):
    n, d, lookups = 2_000_000, 64, 8192  # SparseAdam would add 2 x 512 MB of moments
    emb = nn.Embedding(n, d, sparse=True).cuda()
    with DiskSparseAdam(emb.parameters(), state_dir=state_dir) as opt:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for _ in range(5):
            opt.zero_grad()
            idx = torch.randint(0, n, (lookups,), device="cuda")
            emb(idx).pow(2).sum().backward()
            opt.step()
        torch.cuda.synchronize()
        opt.zero_grad()
        grown = torch.cuda.max_memory_allocated() - before
    # gradient rows, coalesced copy and updates: a few times lookups x d x 4 bytes
    assert grown < 16 * lookups * d * 4, f"GPU memory grew by {grown / 2**20:.1f} MiB"


def test_disk_embedding_feeds_a_cuda_model_and_matches_sparse_adam(tmp_path):
    """A DiskEmbedding's rows go to the GPU and their gradient comes back sparse to the host;
    the weights follow SparseAdam on an ordinary CUDA embedding (the GPU's matmul rounds
    differently from the CPU's, so close, not bit-equal)."""
    from dsa_train import DiskEmbedding

    disk = DiskEmbedding(500, 16, path=tmp_path / "t.table", std=0.1).to("cuda")
    ref = nn.Embedding(500, 16, sparse=True).cuda()
    with torch.no_grad():
        ref.weight.copy_(disk.weight)
    head = nn.Linear(16, 1).cuda()
    reference = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    with DiskSparseAdam(disk.parameters(), lr=0.01, state_dir=tmp_path / "state") as ours:
        for t in range(50):
            idx = torch.randint(0, 500, (256,), generator=torch.Generator().manual_seed(t)).cuda()
            for m, opt in ((disk, ours), (ref, reference)):
                opt.zero_grad()
                out = m(idx)
                assert out.device.type == "cuda"
                head(out).pow(2).sum().backward()
                opt.step()
        assert disk.weight.device.type == "cpu" and disk.weight.grad.is_sparse
        torch.testing.assert_close(disk.weight, ref.weight.cpu(), rtol=0, atol=1e-5)


def test_disk_embedding_vram_does_not_grow_with_the_table(tmp_path):
    """VRAM holds the batch's rows only: a 4M-row table and a 40k-row one use the same."""
    from dsa_train import DiskEmbedding

    peaks = []
    for rows in (40_000, 4_000_000):
        disk = DiskEmbedding(rows, 64, path=tmp_path / f"{rows}.table", std=0.01).to("cuda")
        with DiskSparseAdam(disk.parameters(), state_dir=tmp_path / f"s{rows}") as opt:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            for _ in range(5):
                opt.zero_grad()
                disk(torch.randint(0, rows, (8192,), device="cuda")).pow(2).sum().backward()
                opt.step()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - before)
    assert peaks[1] <= 1.2 * peaks[0] + (1 << 20), f"VRAM peaks {peaks} grew with the table"


# -- the pinned staging of DiskSparseAdam's host round trip ------------------------------------
ROWS, DIM = 3_000, 16


def cuda_gradient(step: int, lookups: int, dtype: torch.dtype) -> torch.Tensor:
    """An uncoalesced sparse gradient (duplicates likely) with ``lookups`` lookups, on the GPU."""
    g = torch.Generator().manual_seed(step)
    rows = torch.randint(0, ROWS, (lookups,), generator=g)
    values = torch.randn(lookups, DIM, generator=g, dtype=dtype)
    return torch.sparse_coo_tensor(rows[None], values, (ROWS, DIM), check_invariants=False).cuda()


def twin_steps(state_dir, dtype, sizes, streams=(None,)):
    """SparseAdam and DiskSparseAdam take the same CUDA gradients of ``sizes`` lookups; step k
    of DiskSparseAdam runs on ``streams[k % len(streams)]`` (None: the default stream),
    ordered with the default stream as a caller must. Returns both parameters and ours."""
    weight = torch.randn(ROWS, DIM, dtype=dtype, device="cuda")
    ref_param, our_param = nn.Parameter(weight.clone()), nn.Parameter(weight.clone())
    reference = torch.optim.SparseAdam([ref_param], lr=0.01)
    ours = DiskSparseAdam([our_param], lr=0.01, state_dir=state_dir)
    for step, lookups in enumerate(sizes):
        grad = cuda_gradient(step, lookups, dtype)
        ref_param.grad = grad.clone()
        reference.step()
        stream = streams[step % len(streams)]
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            our_param.grad = grad.clone()
            ours.step()
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert ours.state[our_param]["step"] == reference.state[ref_param]["step"] == len(sizes)
    return ref_param, our_param, ours


# Growing, shrinking and repeated sizes: each growth replaces a buffer, each repeat reuses one.
SIZES = [10, 100, 50, 1_000, 20, 5_000, 5_000, 300, 12_000, 7, 12_000, 2_000] * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_staged_steps_are_bit_identical_to_sparse_adam(state_dir, dtype):
    reference, ours_param, ours = twin_steps(state_dir, dtype, SIZES)
    with ours:
        assert torch.equal(ours_param, reference), "the weights differ from SparseAdam's"
        largest = max(cuda_gradient(k, n, dtype).coalesce()._nnz() for k, n in enumerate(SIZES))
        staging = ours._staging[ours_param.device]
        for (name, _), buffer in staging.buffers.buffers.items():
            assert buffer.is_pinned()
            width = 1 if name == "rows" else DIM
            assert largest * width <= buffer.numel() <= 2 * largest * width, name


def test_staged_steps_on_alternating_caller_streams_are_bit_identical(state_dir):
    """A caller that changes its current stream between steps (ordering them as CUDA asks):
    each step's copies to the host must follow the stream that made its gradient, and its
    index_add_ on that stream must follow the copy of its updates to the device."""
    streams = (torch.cuda.Stream(), None, torch.cuda.Stream())
    reference, ours_param, ours = twin_steps(state_dir, torch.float32, SIZES, streams)
    with ours:
        assert torch.equal(ours_param, reference)


def test_empty_gradients_count_as_steps_and_copy_nothing(state_dir):
    reference, ours_param, ours = twin_steps(state_dir, torch.float32, [0, 0])
    with ours:
        assert not ours._staging, "an empty gradient was staged"
    reference, ours_param, ours = twin_steps(state_dir.with_name("mixed"), torch.float32, [0, 500, 0, 0, 800, 0, 40])
    with ours:
        assert torch.equal(ours_param, reference)


def test_a_step_no_larger_than_before_allocates_no_pinned_memory(state_dir):
    param = nn.Parameter(torch.zeros(ROWS, DIM, device="cuda"))
    grad = cuda_gradient(0, 4_096, torch.float32)
    with DiskSparseAdam([param], state_dir=state_dir) as opt:
        param.grad = grad
        opt.step()
        buffers = opt._staging[param.device].buffers.buffers
        first = dict(buffers)
        assert {name for name, _ in first} == {"rows", "values", "updates"}
        for step, lookups in ((1, 4_096), (2, 100), (3, 4_096)):
            param.grad = grad if lookups == 4_096 else cuda_gradient(step, lookups, torch.float32)
            opt.step()
            assert buffers.keys() == first.keys()
            assert all(buffers[key] is first[key] for key in first), f"step {step} allocated a pinned buffer"
