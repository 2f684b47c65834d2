"""Joining the process group ``torchrun`` set up, and turning a lost peer into an error that
names the rank and the step instead of a hang.

``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``) decides the ranks; :func:`from_environment` reads them
and :meth:`World.join` initialises the default group with the recipe's backend and timeout.
Every collective after that runs inside :meth:`World.guard`: a peer that died or hung makes
gloo (or NCCL) raise once the timeout passes, and the guard re-raises it as a
:class:`~dsa_train.errors.TrainingError` saying which rank saw it, at which step, doing what.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError, TrainingError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class World:
    """This process's place among the ranks of one run."""

    rank: int
    world_size: int
    local_rank: int
    step: int = 0  # the step being run, named in errors

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def join(self, backend: str, timeout: float, device: torch.device) -> None:
        """Initialise the default process group. Rows and gradients travel as host tensors
        (tables and moments live on the host), so ``"auto"`` is gloo; ``"nccl"`` adds NCCL
        for CUDA tensors beside gloo for host ones (``cpu:gloo,cuda:nccl``)."""
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError(
                [f"distributed.backend: 'nccl' needs train.device cuda, the run computes on {device.type}"]
            )
        backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
        if torch.cuda.is_available():  # each rank of a machine on its own GPU
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        with self.guard("joining the process group"):
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @contextmanager
    def guard(self, doing: str) -> Iterator[None]:
        """Run collectives; a peer lost on the way becomes a ``TrainingError`` naming this rank,
        the step and ``doing``."""
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, TrainingError) or not _is_peer_failure(e):
                raise
            raise TrainingError(
                f"rank {self.rank} of {self.world_size} stopped at step {self.step} while {doing}: another rank stopped "
                f"answering ({str(e).splitlines()[0][:200]})",
                hint="look at the other ranks' output for the first error; after fixing it, run the same command with "
                "--resume to continue from the newest complete checkpoint",
            ) from e


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(
        word in text
        for word in ("connection", "timed out", "timeout", "broken pipe", "closed", "gloo", "nccl", "socket")
    )


def from_environment() -> World | None:
    """The world ``torchrun`` describes in this process's environment, or ``None`` when it
    was not started by a launcher (a single process: today's code path)."""
    if "WORLD_SIZE" not in os.environ:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name)]
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        rank = world = local = -1
    if missing or not 0 <= rank < world:
        raise ConfigError(
            [
                f"the environment says WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} but "
                + (f"lacks {', '.join(missing)}" if missing else f"RANK={os.environ.get('RANK')!r}")
            ],
            source="the launch environment",
            hint="launch with torchrun (for example torchrun --nproc-per-node 2 -m dsa_train run RECIPE), or unset WORLD_SIZE for one process",
        )
    return World(rank, world, local)


def broadcast_bytes(data: bytes, source: int = 0) -> bytes:
    """``data`` of rank ``source`` on every rank (a path, a recipe, a small JSON document)."""
    length = torch.tensor([len(data)])
    dist.broadcast(length, source)
    mine = dist.get_rank() == source
    buffer = torch.tensor(list(data), dtype=torch.uint8) if mine else torch.empty(int(length), dtype=torch.uint8)
    if int(length):
        dist.broadcast(buffer, source)
    return bytes(buffer.tolist())


def broadcast_int(value: int, source: int = 0) -> int:
    """``value`` of rank ``source`` on every rank."""
    box = torch.tensor([value])
    dist.broadcast(box, source)
    return int(box)
