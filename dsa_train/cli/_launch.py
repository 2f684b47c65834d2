"""What ``dsa-train run`` and ``dsa-train eval`` share: where a command computes, and running the
same command as several ranks on this machine (``--nproc``, ``torchrun --standalone``)."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from enum import Enum

import typer

from ._errors import debug


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


def launch_local(nproc: int) -> int:
    """Run this same command as ``nproc`` ranks under ``torchrun --standalone`` (one machine);
    each gets an equal share of the cores unless OMP_NUM_THREADS says otherwise."""
    args, skip = [], False
    for arg in sys.argv[1:]:  # the command line minus --nproc
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            args.append(arg)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torchrun --standalone, without its own log lines and traceback: each rank prints its error
    logging.getLogger("torch.distributed.elastic").setLevel(logging.INFO if debug() else logging.CRITICAL)
    try:
        # The launcher's per-rank folders (error files) in a temporary folder removed after the
        # job, not a torchelastic_* folder left in /tmp by every run.
        with tempfile.TemporaryDirectory(prefix="dsa-train-ranks-") as logs:
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=nproc,
                run_id=uuid.uuid4().hex,
                logs_specs=DefaultLogsSpecs(log_dir=logs),
                rdzv_backend="c10d",
                rdzv_endpoint="localhost:0",
                max_restarts=0,
                monitor_interval=0.1,
            )
            elastic_launch(config, sys.executable)("-m", "dsa_train", *args)
    except ChildFailedError as e:
        if debug():
            raise
        failed = sorted(e.failures)
        ranks = f"rank {failed[0]}" if len(failed) == 1 else "ranks " + ", ".join(map(str, failed))
        typer.echo(
            f"dsa-train: {ranks} of {nproc} failed ({'its error is' if len(failed) == 1 else 'their errors are'} above)",
            err=True,
        )
        return 1
    return 0
