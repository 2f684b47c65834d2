"""The reused host buffers of the CUDA round trip, on CPU memory (``pin_memory=False``).

The pinned, stream-ordered use of them is tested in ``tests/test_cuda.py`` on a CUDA machine.
"""

from __future__ import annotations

import math

import torch

from dsa_train.optim.staging import HostBuffers


def test_a_request_that_fits_is_a_view_of_the_same_buffer():
    buffers = HostBuffers(pin_memory=False)
    first = buffers.take("values", (100, 8), torch.float32)
    buffer = buffers.buffers[("values", torch.float32)]
    second = buffers.take("values", (30, 8), torch.float32)
    assert first.shape == (100, 8) and second.shape == (30, 8) and second.is_contiguous()
    assert buffers.buffers[("values", torch.float32)] is buffer
    assert first.data_ptr() == second.data_ptr() == buffer.data_ptr()
    assert not buffer.is_pinned()


def test_a_request_that_does_not_fit_at_least_doubles_the_buffer():
    buffers = HostBuffers(pin_memory=False)
    buffers.take("rows", (100,), torch.int64)
    buffers.take("rows", (150,), torch.int64)
    assert buffers.buffers[("rows", torch.int64)].numel() == 200  # twice the old size
    buffers.take("rows", (1_000,), torch.int64)
    assert buffers.buffers[("rows", torch.int64)].numel() == 1_000  # more than twice: what is asked


def test_names_and_dtypes_have_buffers_of_their_own():
    buffers = HostBuffers(pin_memory=False)
    values = buffers.take("values", (10, 4), torch.float32)
    updates = buffers.take("updates", (10, 4), torch.float32)
    wide = buffers.take("values", (10, 4), torch.float64)
    values.fill_(1.0)
    updates.fill_(2.0)
    wide.fill_(3.0)
    assert values.eq(1.0).all() and updates.eq(2.0).all() and wide.dtype == torch.float64
    assert len(buffers.buffers) == 3


def test_varying_batches_stop_allocating_and_stay_within_twice_the_largest():
    """Unique rows per step vary from batch to batch: after the first few growths no step
    allocates, and a buffer never holds more than twice the largest request."""
    buffers = HostBuffers(pin_memory=False)
    sizes = torch.randint(1_000, 65_536, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    allocations, seen = 0, None
    for size in sizes:
        buffers.take("values", (size, 16), torch.float32)
        buffer = buffers.buffers[("values", torch.float32)]
        allocations += buffer is not seen
        seen = buffer
    # each growth at least doubles, and the last one started below the largest request
    assert allocations < 2 + math.log2(max(sizes) / sizes[0])
    assert max(sizes) * 16 <= seen.numel() <= 2 * max(sizes) * 16
