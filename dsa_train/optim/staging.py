"""Host buffers and a side stream for the rows a CUDA parameter's step sends through the host.

A CUDA parameter's step copies its coalesced gradient to the host, updates the moments
there and copies the updates back (see ``disk_sparse_adam._step_through_host``). Copies
between the GPU and page-locked ("pinned") memory run asynchronously at the bus's full rate;
pageable memory is copied through a driver bounce buffer and blocks. Pinning is slow
(``cudaHostAlloc``), so the buffers are kept and reused from step to step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class HostBuffers:
    """Named 1-D host buffers, kept from one request to the next.

    A request that fits returns a view of the buffer the last one got; one that does not
    replaces it by one of at least twice its size, so batches of varying size stop
    allocating after a few steps (a buffer holds at most twice the largest request).
    ``pin_memory=False`` gives ordinary memory (tests, machines without CUDA).

    The caller makes sure no asynchronous copy still reads or writes a buffer when it asks
    for it again: a request may write it or drop it.
    """

    def __init__(self, *, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.buffers: dict[tuple[str, torch.dtype], Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A contiguous tensor of ``shape`` at the start of the buffer ``(name, dtype)``."""
        needed = math.prod(shape)
        key = (name, dtype)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < needed:
            size = max(needed, 2 * buffer.numel()) if buffer is not None else needed
            buffer = self.buffers[key] = torch.empty(size, dtype=dtype, pin_memory=self.pin_memory)
        return buffer[:needed].view(shape)


class CudaStaging:
    """One CUDA device's pinned buffers, the side stream that copies through them, and the
    events that order those copies with the host and with the caller's current stream.

    The copies run on a stream of their own so that they queue behind nothing but what they
    wait for explicitly (the kernels that made the gradient) and so that the current stream
    waits only for the copy the next kernel reads (the updates), not for the host.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers = HostBuffers(pin_memory=True)
        self.stream = torch.cuda.Stream(device)
        self._arrived = torch.cuda.Event()  # the gradient's copies to the host are done
        self._released = torch.cuda.Event()  # the last copy out of the buffers is done

    def to_host(self, rows: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Pinned copies of a coalesced gradient's ``rows`` (U,) and ``values`` (U, W), made on
        the current stream, once they have arrived; and a pinned (U, W) buffer for the updates.

        ``rows`` and ``values`` must stay referenced until this returns: the side stream
        reads them, and a freed block could be handed to the current stream's next kernel.
        """
        # A buffer is not written (by a copy or by the host) nor dropped (when it grows)
        # until the last copy out of it, the previous call's updates to the device, has
        # completed. Without this wait the host's update of this step could overwrite
        # `updates` while that copy still reads it, and the parameter would receive a mix
        # of two steps' updates. The queue order of the side stream would also imply it
        # for the host's writes (they follow `_arrived`, queued behind that copy); the
        # explicit wait keeps the rule true by itself. In a training loop it returns at
        # once: step() has read the new gradient back for its checks, and the kernels
        # that made it ran after the index_add_ that waited for that copy.
        self._released.synchronize()
        host_rows = self.buffers.take("rows", tuple(rows.shape), rows.dtype)
        host_values = self.buffers.take("values", tuple(values.shape), values.dtype)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the coalesce that made rows and values
        with torch.cuda.stream(self.stream):
            host_rows.copy_(rows, non_blocking=True)
            host_values.copy_(values, non_blocking=True)
        self._arrived.record(self.stream)
        # While the copies run: the updates buffer (a pinned allocation when it grows).
        updates = self.buffers.take("updates", tuple(values.shape), values.dtype)
        self._arrived.synchronize()
        return host_rows, host_values, updates

    def to_device(self, updates: Tensor) -> Tensor:
        """``updates`` (the buffer from :meth:`to_host`, filled by the host) on the device,
        ready for kernels queued on the current stream after this returns. Does not wait."""
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            moved = updates.to(self.device, non_blocking=True)  # allocated for the side stream
        self._released.record(self.stream)
        current.wait_event(self._released)
        # The current stream uses `moved`: its block must not be reused before that use is done.
        moved.record_stream(current)
        return moved
