"""``DiskSparseAdam``: ``torch.optim.SparseAdam`` with its moments in memory-mapped files."""

from __future__ import annotations

import math
import re
import sys
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from ..errors import StateError, TrainingError
from ..fsutil import require_linux
from . import native
from .functional import (
    AdamStep,
    RowGroups,
    Workspace,
    coalesce_rows,
    compact_adam_rows_,
    fused_sparse_adam_rows_,
    sparse_adam_rows_,
)
from ..storage.format import LAYOUT, TABLE_LAYOUT
from ..storage.residency import memory_shortfall, resolve_budget
from ..storage.row_file import DTYPES, RowFile, dtype_name
from .staging import CudaStaging
from ..storage.state_dir import StateDirectory
from ..storage.table import Table, table_of

PRESSURE_CHECK_SECONDS = 1.0  # how often a step looks at the machine's free memory

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class DiskSparseAdam(Optimizer):
    r"""SparseAdam whose first and second moments live on disk, not in RAM or VRAM.

    A drop-in for :class:`torch.optim.SparseAdam` with the same arguments, semantics and
    errors, plus a ``state_dir``. For every parameter with a sparse gradient touching the rows
    :math:`R` (duplicates summed into :math:`g_r`; :math:`g \to -g` with ``maximize``), a
    step increments the parameter's step counter :math:`t` and, for :math:`r \in R` only,

    .. math::
        m_r &\leftarrow m_r + (1 - \beta_1)\,(g_r - m_r) \\
        v_r &\leftarrow v_r + (1 - \beta_2)\,(g_r^2 - v_r) \\
        \theta_r &\leftarrow \theta_r - \gamma\,\frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}\,
            \frac{m_r}{\sqrt{v_r} + \epsilon}

    The counter advances on every ``step()`` in which the parameter has a gradient, also an
    empty one. :math:`m` and :math:`v` start at zero and are read and written only at the
    touched rows, from one ``<name>.rows`` file per parameter in ``state_dir`` that holds
    each row's ``[m | v]`` record contiguously; optimizer memory grows with the batch, not
    with the table. With CUDA parameters only the touched gradient rows travel to the host
    and only their updates travel back; the moments never occupy GPU memory. The weight of a
    :class:`~dsa_train.DiskEmbedding` keeps its moments next to its rows in the embedding's
    own table file (records ``[w | m | v]``), so a touched row is one read and one write;
    the manifest in ``state_dir`` then names that table.

    Memory: the rows a step changes stay in this process's memory (a copy-on-write mapping of
    the row files) and are written to disk by :meth:`flush` (a checkpoint) or :meth:`close`,
    once each, never by the kernel in between. ``memory_budget`` caps them: past it, the rows
    least recently written leave memory, each written once as it leaves. Rows read but not
    changed are the file's pages in the page cache, which the kernel drops as it needs.

    The directory is locked while the optimizer is open. Reopening it with the same
    parameters (same names, shapes and dtypes) continues from the saved moments and step
    counters. :meth:`flush` makes the state durable; :meth:`close` (or leaving a ``with``
    block, or the interpreter exiting) flushes and releases the lock. A directory left
    without a flush (the process was killed) refuses to open unless ``allow_unclean=True``,
    since its moments may be ahead of its step counters.

    Args:
        params: tensors, param-group dicts, or ``named_parameters()`` pairs. Names (with
            characters outside ``[A-Za-z0-9._-]`` replaced by ``_``) name the row files;
            unnamed parameters get ``param0``, ``param1``, ... in order.
        lr: learning rate (default: 1e-3)
        betas: coefficients of the running averages of the gradient and its square
            (default: (0.9, 0.999))
        eps: term added to :math:`\sqrt{v}` before bias correction (default: 1e-8)
        state_dir: directory for the moments; created if missing. Put it on a local SSD.
        maximize: maximize the objective instead of minimizing it (default: False)
        allow_unclean: open a directory that was not flushed before its writer stopped.
        nonfinite: what a NaN or Inf in a gradient does: ``"error"`` (default) raises a
            :class:`~dsa_train.errors.TrainingError` naming the parameter and the step,
            ``"skip"`` skips the whole step (counted in ``skipped_steps``). Either way it is
            found before anything is written, so the state on disk is never poisoned.
            (SparseAdam has no such check: it would write the NaN.)
        memory_budget: the memory the changed rows of all parameters may hold between
            flushes: bytes, a size (``"2GiB"``, ``"512MB"``) or a share of the memory this
            process can still take when the optimizer opens (``"75%"``, the default; divided
            among the processes ``torchrun`` started on this machine). Each row file gets a
            share in proportion to its size. ``0`` writes every changed page out after the step.

    Example::

        emb = torch.nn.EmbeddingBag(10_000_000, 128, sparse=True)
        with DiskSparseAdam(emb.parameters(), lr=1e-3, state_dir="./opt_state_cache") as opt:
            for bags, offsets in loader:
                opt.zero_grad()
                emb(bags, offsets).pow(2).sum().backward()
                opt.step()
    """

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        *,
        state_dir: str | Path,
        maximize: bool = False,
        allow_unclean: bool = False,
        nonfinite: str = "error",
        first_moment: str = "full",
        second_moment: str = "full",
        memory_budget: int | str | None = None,
    ) -> None:
        require_linux("DiskSparseAdam")
        _check_hyperparameters(lr, betas, eps)
        if nonfinite not in ("error", "skip"):
            raise ValueError(f"Invalid nonfinite policy: {nonfinite!r} (use 'error' or 'skip')")
        if first_moment not in ("full", "bfloat16"):
            raise ValueError(f"Invalid first_moment: {first_moment!r} (use 'full' or 'bfloat16')")
        if second_moment not in ("full", "row"):
            raise ValueError(f"Invalid second_moment: {second_moment!r} (use 'full' or 'row')")
        parts = ["m:bfloat16" if first_moment == "bfloat16" else "m", "v:row" if second_moment == "row" else "v"]
        self._layout = "|".join(parts)  # "m|v" unless a smaller state was asked for
        self.memory_budget = resolve_budget(memory_budget)  # bytes
        self._pressure_checked = 0.0  # monotonic time free memory was last looked at
        self._pressure_warned = False
        self.nonfinite = nonfinite
        self.skipped_steps = 0  # steps skipped for a non-finite gradient (nonfinite="skip")
        self._store: StateDirectory | None = None
        self._keys: dict[Tensor, str] = {}
        self._names: dict[str, str] = {}  # file key -> the parameter's own name
        self._workspace = Workspace()
        self._staging: dict[torch.device, CudaStaging] = {}  # per CUDA device, made on first use
        self._write_hooks: OrderedDict[int, Callable[[Path, Tensor], None]] = OrderedDict()  # register_write_hook
        defaults = {"lr": lr, "betas": betas, "eps": eps, "maximize": maximize}
        super().__init__(params, defaults)
        _check_params(self.param_groups, range(len(self.param_groups)), compact=self._layout != LAYOUT)
        named = self._assign_keys(self.param_groups)
        keys = {p: key for p, (key, _) in named.items()}

        store = StateDirectory(Path(state_dir), allow_unclean=allow_unclean)
        try:
            if store.known():
                self._refuse_ambiguous_reopen(keys, store.path)
            unknown = [k for k in keys.values() if k not in store.known()] if store.known() else []
            if unknown:
                raise StateError(
                    f"state_dir '{store.path}' holds no parameter named {', '.join(map(repr, unknown))} "
                    f"(it holds {', '.join(map(repr, store.known()))})",
                    hint="reopen it with the same model and parameter names, or use a fresh state_dir",
                )
            steps = store.open({key: self._spec(p) for p, key in keys.items()})
        except BaseException:
            store.close()
            raise
        self._store = store
        store.record_budget(self.memory_budget)
        self._keys = keys
        self._names = dict(named.values())
        self._restore_steps(steps)
        self._share_budget()
        absent = [k for k in store.known() if k not in keys.values()]
        if absent:
            warnings.warn(
                f"state_dir '{store.path}' also holds {', '.join(map(repr, absent))}, which this "
                "optimizer was not given; their files are kept as they are",
                stacklevel=2,
            )
        # Flush and unlock if the optimizer is dropped or the interpreter exits without close().
        self._finalizer = weakref.finalize(self, _flush_and_close_unattended, store)

    # -- parameters ---------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if self._store is None:  # still inside __init__, which opens all groups at once
            return
        index = len(self.param_groups) - 1
        try:
            _check_params(self.param_groups[index : index + 1], [index], compact=self._layout != LAYOUT)
            named = self._assign_keys(self.param_groups[index : index + 1], start=len(self._keys))
            keys = {p: key for p, (key, _) in named.items()}
            steps = self._store.open({key: self._spec(p) for p, key in keys.items()})
        except BaseException:
            self.param_groups.pop()
            raise
        self._keys.update(keys)
        self._names.update(named.values())
        self._restore_steps(steps)
        self._share_budget()

    def _refuse_ambiguous_reopen(self, keys: dict[Tensor, str], path: Path) -> None:
        """Unnamed parameters are matched to their files by position alone; two of the same
        shape and dtype given in another order would swap moments silently, so refuse."""
        by_spec: dict[tuple, list[str]] = {}
        for group in self.param_groups:
            if not group.get("param_names"):
                for p in group["params"]:
                    by_spec.setdefault((tuple(p.shape), p.dtype), []).append(keys[p])
        clash = next((k for k in by_spec.values() if len(k) > 1), None)
        if clash:
            raise StateError(
                f"state_dir '{path}' was reopened with unnamed parameters of the same shape and dtype "
                f"({', '.join(clash)}): only their order would decide which moments each one gets, "
                "and another order would swap them without any error",
                hint=f"name them: pass model.named_parameters(), or (name, tensor) pairs such as "
                f"[({clash[0]!r}, ...), ({clash[1]!r}, ...)] in the order the state was created",
            )

    def _assign_keys(self, groups: list[dict], start: int = 0) -> dict[Tensor, tuple[str, str]]:
        """Each parameter's file-safe, unique key (its sanitised name, else ``paramK``) and name."""
        keys: dict[Tensor, tuple[str, str]] = {}
        named_as = dict(self._names)
        index = start
        for group in groups:
            names = group.get("param_names") or [None] * len(group["params"])
            for p, name in zip(group["params"], names):
                key = f"param{index}" if name is None else _file_key(name)
                index += 1
                if key in named_as:
                    raise ValueError(
                        f"parameter names {named_as[key]!r} and {name!r} both map to the file "
                        f"name '{key}.rows'; rename one of them"
                    )
                named_as[key] = name if name is not None else key
                keys[p] = (key, named_as[key])
        return keys

    def _restore_steps(self, steps: dict[str, int]) -> None:
        for p, key in self._keys.items():
            if steps.get(key) and "step" not in self.state[p]:
                self.state[p]["step"] = steps[key]
        self._store.groups = self._groups_summary()

    def _share_budget(self) -> None:
        """Give each row file a share of the memory budget in proportion to its size."""
        files = self._store.files.values()
        total = sum(f.spec.file_bytes for f in files) or 1
        for row_file in files:
            row_file.set_budget(self.memory_budget * row_file.spec.file_bytes // total)

    def _give_way_to_memory_pressure(self, store: StateDirectory) -> None:
        """At most once every ``PRESSURE_CHECK_SECONDS``: if free memory is below its floor
        (:func:`~.residency.memory_shortfall`), write that much of the changed rows out of
        memory now, whatever the budget, and say so once."""
        now = time.monotonic()
        if now - self._pressure_checked < PRESSURE_CHECK_SECONDS:
            return
        self._pressure_checked = now
        short = memory_shortfall()
        if not short:
            return
        files = list(store.files.values())
        total = sum(f.spec.file_bytes for f in files) or 1
        shed = sum(f.shed(-(-short * f.spec.file_bytes // total)) for f in files)
        if shed and not self._pressure_warned:
            self._pressure_warned = True
            warnings.warn(
                f"memory is short ({short / 2**20:,.0f} MiB below the free floor): DiskSparseAdam wrote "
                f"{shed / 2**20:,.0f} MiB of changed rows out of memory early, and will again whenever memory is "
                f"short; pass a smaller memory_budget (now {self.memory_budget / 2**20:,.0f} MiB) to keep room",
                stacklevel=3,
            )

    def residency(self) -> dict[str, int]:
        """The memory budget and what the changed rows hold of it now, in bytes, with what
        the state files were written since they were opened: ``{"memory_budget",
        "resident_bytes", "written_bytes", "evicted_bytes"}`` (evicted: changed pages the
        budget sent out of memory, each written once as it left)."""
        files = list(self._open_store().files.values())
        stats = [f.write_stats() for f in files]
        return {
            "memory_budget": self.memory_budget,
            "resident_bytes": sum(f.resident_bytes() for f in files),
            "written_bytes": sum(s["written_bytes"] for s in stats),
            "evicted_bytes": sum(s["evicted_bytes"] for s in stats),
        }

    def _groups_summary(self) -> list[dict]:
        return [
            {
                "lr": float(g["lr"]),
                "betas": [float(b) for b in g["betas"]],
                "eps": float(g["eps"]),
                "maximize": bool(g["maximize"]),
                "params": [self._keys[p] for p in g["params"]],
            }
            for g in self.param_groups
        ]

    # -- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        store = self._open_store()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _check_grad(p, self._keys[p])
                    work.append((group, p))
        # Everything that can refuse the step does so before the first byte is written.
        for _, p in work:
            values = p.grad._values()
            # One cheap pass: a NaN or Inf anywhere makes the sum non-finite (and a finite sum
            # proves there is none); only then the exact element-wise test (an overflowing
            # sum of finite values passes it).
            if not bool(torch.isfinite(values.sum())) and not bool(torch.isfinite(values).all()):
                if self.nonfinite == "skip":
                    self.skipped_steps += 1
                    return loss
                key = self._keys[p]
                raise TrainingError(
                    f"parameter '{key}' has a non-finite gradient (NaN or Inf) at its step "
                    f"{self.state[p].get('step', 0) + 1}; the step was refused and nothing was written",
                    hint="lower the learning rate or check the loss for overflow; nonfinite='skip' skips such steps",
                )
        for _, p in work:
            store.files[self._keys[p]].reserve(p.grad._indices()[0])
        self._make_room(store, work)
        if work and store.clean:
            store.groups = self._groups_summary()
            store.mark_dirty()
        try:
            for group, p in work:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                store.steps[self._keys[p]] = state["step"]
                if p.grad._values().numel() == 0:
                    continue  # an empty gradient counts as a step, as in SparseAdam
                self._announce(store.files[self._keys[p]], p.grad._indices()[0])  # before the first byte
                self._update(p, store.files[self._keys[p]], group, state["step"])
        except BaseException as e:
            # Some parameters may be updated and others not: the directory stays unclean.
            store.broken = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise
        try:
            for _, p in work:
                store.files[self._keys[p]].settle()  # past the budget, the coldest rows leave
            self._give_way_to_memory_pressure(store)
        except OSError as e:
            raise StateError(
                f"could not write rows leaving memory to '{store.path}': {e.strerror or e}; they stay "
                "in memory and the step is complete",
                hint="free disk space (or raise memory_budget) and continue; flush() writes them",
            ) from e
        return loss

    def _make_room(self, store, work) -> None:
        """Before the first write: the step's pages are counted now (``reserve`` marked them),
        so past the budget the coldest other pages leave first and the step's writes do not
        take the moments' memory past it (a step that alone needs more than the budget holds
        its own pages, no others). Where the disk cannot take the pages that would leave, the
        step goes on over the budget: the eviction after it meets the same error and names it,
        with the step complete."""
        for _, p in work:
            try:
                store.files[self._keys[p]].make_room()
            except OSError:
                pass

    @torch.no_grad()
    def load_rows(self, param: Tensor, rows: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int) -> None:
        """Set the moments of ``rows`` of ``param`` and its step counter :math:`t`: how a
        table's optimizer state moves between layouts (a job resumed at another number of
        ranks copies each row's ``m`` and ``v`` to its new owner).

        ``exp_avg`` and ``exp_avg_sq`` are ``(len(rows), W)``; they are stored in the state's
        own dtype and layout (a row-wise ``v`` keeps column 0, which a row-wise state gives
        for every column). The rows are announced to the write hooks, as a step's are; the
        other rows keep their moments."""
        store = self._open_store()
        key = self._keys[param]
        moments = store.files[key]
        rows = rows.reshape(-1).to(torch.int64).cpu()
        moments.reserve(rows)
        if store.clean:
            store.groups = self._groups_summary()
            store.mark_dirty()
        self._announce(moments, rows)
        moments.m[rows] = exp_avg.to(moments.m.dtype)
        moments.v[rows] = exp_avg_sq[:, : moments.v.shape[1]].to(moments.v.dtype)
        moments.settle()
        self.state[param]["step"] = step
        store.steps[key] = step

    def _spec(self, p: Tensor) -> tuple[tuple[int, ...], str, Table | None, str]:
        table = table_of(p)
        return tuple(p.shape), dtype_name(p.dtype), table, TABLE_LAYOUT if table is not None else self._layout

    def _update(self, p: Tensor, moments: RowFile, group: dict, step: int) -> None:
        lr = group["lr"]
        adam = AdamStep(
            step=step,
            lr=lr.squeeze() if isinstance(lr, Tensor) else lr,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            maximize=group["maximize"],
        )
        if p.device.type == "cpu":
            _step_in_place(p, moments, adam, self._workspace)
        else:
            _step_through_host(p, moments, adam, self._workspace, self._cuda_staging(p.device))

    def _cuda_staging(self, device: torch.device) -> CudaStaging | None:
        """The reused pinned buffers and side stream of a CUDA device; ``None`` for others."""
        if device.type != "cuda":
            return None
        if device not in self._staging:
            self._staging[device] = CudaStaging(device)
        return self._staging[device]

    # -- state --------------------------------------------------------------------------
    @property
    def state_dir(self) -> Path:
        return self._open_store().path

    @property
    def state_id(self) -> str:
        """The id of the state directory's content (its manifest's ``state_id``)."""
        return self._open_store().state_id

    def _open_store(self) -> StateDirectory:
        if self._store is None:
            raise StateError(
                "this DiskSparseAdam is closed",
                hint="create a new DiskSparseAdam on the same state_dir to continue from it",
            )
        return self._store

    def row_files(self) -> dict[Path, int]:
        """The row files this optimizer writes (a parameter's ``.rows`` file in ``state_dir``, or
        its disk table), each with its number of rows."""
        files = self._open_store().files
        return {files[key].path: p.shape[0] for p, key in self._keys.items()}

    def live_row_file(self, path: Path) -> RowFile | None:
        """The open row file at ``path`` (one of :meth:`row_files`) as this process maps it, its
        unflushed rows included, or ``None``: what a checkpoint copies the state from."""
        target = Path(path).resolve()
        return next((f for f in self._open_store().files.values() if f.path.resolve() == target), None)

    def snapshot_manifest(self) -> bytes:
        """The manifest :meth:`flush` would commit now (clean, the step counters of the steps
        taken), as bytes; nothing is written. With the row files as :meth:`live_row_file` shows
        them, it is the state a flush would leave, without the flush."""
        store = self._open_store()
        store.groups = self._groups_summary()
        return store.snapshot_manifest()

    def register_write_hook(self, hook: Callable[[Path, Tensor], None]) -> RemovableHandle:
        """Call ``hook(path, rows)`` before this optimizer writes the records ``rows`` (an int64
        tensor, duplicates allowed) of the row file ``path`` (one of :meth:`row_files`): a
        step's touched rows, :meth:`load_rows`' rows. They are announced before the first byte,
        so a step that fails half-way has announced them. Writes made by anything else (loading
        weights into a table, say) are not seen. ``handle.remove()`` unregisters the hook."""
        handle = RemovableHandle(self._write_hooks)
        self._write_hooks[handle.id] = hook
        return handle

    def _announce(self, row_file: RowFile, rows: Tensor) -> None:
        for hook in self._write_hooks.values():
            hook(row_file.path, rows)

    def flush(self) -> None:
        """Write every touched row to disk, then commit the step counters (durable on return)."""
        store = self._open_store()
        store.groups = self._groups_summary()
        store.flush()

    def close(self) -> None:
        """Flush, unmap the row files and release the directory lock. Safe to call twice."""
        if self._store is None:
            return
        self._finalizer.detach()
        store, self._store = self._store, None
        store.groups = self._groups_summary()
        self._workspace.close_pool()
        self._staging.clear()  # its pinned buffers go back to torch's host cache
        _flush_and_close(store)

    @property
    def closed(self) -> bool:
        return self._store is None

    def __getstate__(self):
        raise TypeError(
            "DiskSparseAdam cannot be pickled or copied: its moments live in state_dir. Save "
            "state_dict() and open a new DiskSparseAdam on the directory (or a copy of it) instead."
        )

    def __enter__(self) -> DiskSparseAdam:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self) -> dict:
        """The step counters and hyper-parameters, plus a reference to the state directory.

        The moments stay in the directory: the dict is a few hundred bytes whatever the size
        of the tables. Copy the directory (after :meth:`flush`) to snapshot them.
        """
        state = super().state_dict()
        # torch hands out the live per-parameter dicts; ours are tiny, so copy them, and a
        # saved state_dict keeps the step counters it was saved with.
        state["state"] = {index: dict(entry) for index, entry in state["state"].items()}
        store = self._open_store()
        state["disk_state"] = {"state_dir": str(store.path.resolve()), "state_id": store.state_id}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load hyper-parameters and step counters saved by :meth:`state_dict`.

        The state dict must come from this state directory at the steps it is at now: the
        moments on disk cannot be rolled back to another point in time.
        """
        store = self._open_store()
        disk = state_dict.get("disk_state")
        if disk is None:
            raise StateError(
                "this state_dict was not made by DiskSparseAdam (it has no 'disk_state' entry)",
                hint="load a state_dict saved from DiskSparseAdam.state_dict()",
            )
        if disk.get("state_id") != store.state_id:
            raise StateError(
                f"this state_dict belongs to the state directory '{disk.get('state_dir')}' "
                f"(id {disk.get('state_id')}), not to '{store.path}' (id {store.state_id})",
                hint="open the optimizer on the state directory the state_dict was saved with",
            )
        ours = [self.state[p].get("step", 0) if p in self.state else 0 for g in self.param_groups for p in g["params"]]
        theirs = [state_dict["state"].get(i, {}).get("step", 0) for i in range(len(ours))]
        if ours != theirs:
            raise StateError(
                f"this state_dict was saved at steps {theirs}, but state_dir '{store.path}' "
                f"holds moments at steps {ours}; the moments on disk cannot be rolled back",
                hint="restore a copy of the state directory taken together with the state_dict "
                "(a checkpoint), then load it",
            )
        for index, group in enumerate(state_dict.get("param_groups", [])):
            try:
                _check_hyperparameters(group["lr"], group["betas"], group["eps"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"state_dict param group {index}: {e}") from None
        rest = {k: v for k, v in state_dict.items() if k != "disk_state"}
        super().load_state_dict(rest)
        store.groups = self._groups_summary()


def _step_in_place(p: Tensor, moments: RowFile, adam: AdamStep, workspace: Workspace) -> None:
    """A CPU parameter: its rows are updated where they are."""
    _update_rows(moments, p.grad, adam, workspace, param=p)


def _step_through_host(
    p: Tensor, moments: RowFile, adam: AdamStep, workspace: Workspace, staging: CudaStaging | None = None
) -> None:
    """An accelerator parameter: coalesce there, bring only the touched rows to the host,
    send only their updates back, and add them where the parameter lives.

    On CUDA (``staging`` given) the rows and values go into pinned buffers reused from step
    to step, on a side stream, and the updates come back from one the same way; the host
    computes exactly what it computes for a CPU parameter, so the weights stay SparseAdam's.

    What overlaps: the copies of the rows and of the values are queued back to back and
    waited for once, while the host takes the updates buffer; the copy of the updates to
    the device and the ``index_add_`` are queued and not waited for, so the host goes on to
    the next parameter and ``step()`` returns while they run. The next forward is queued
    behind the ``index_add_`` on the same stream, so it reads the updated parameter.
    What cannot: for one parameter the chain coalesce, copy to the host, host update, copy
    back, ``index_add_`` is strict (each needs the whole result of the one before), and the
    GPU idles during the host update unless the caller queued other work. Starting the next
    forward before the update has landed would read stale weights and change the results.
    Splitting the rows into chunks to pipeline copies with the host update would save at
    most the copies: 32 MiB each way for 65,536 float32 rows of 128, about 1.5 ms at the
    bus's rate (an estimate, not measured here), against the host update's tens of ms
    (docs/benchmarks.md: 27-59 ms for such a step on two CPU cores).

    Without ``staging`` (another accelerator, or a CPU parameter in the tests) the copies
    are ordinary blocking ones into new buffers.
    """
    coalesced = p.grad.coalesce()
    rows = coalesced._indices()[0]
    values = coalesced._values().reshape(rows.numel(), moments.spec.row_width)
    if staging is None:
        host_rows, host_values = rows.cpu(), values.cpu()
        updates = torch.empty(host_values.shape, dtype=p.dtype)
    else:
        host_rows, host_values, updates = staging.to_host(rows, values)
    host_grad = torch.sparse_coo_tensor(
        host_rows[None], host_values.view(-1, *p.shape[1:]), p.shape, is_coalesced=True, check_invariants=False
    )
    _update_rows(moments, host_grad, adam, workspace, out=updates)
    moved = updates.to(p.device) if staging is None else staging.to_device(updates)
    p.index_add_(0, rows, moved.view(-1, *p.shape[1:]))


def _update_rows(
    row_file: RowFile,
    grad: Tensor,
    adam: AdamStep,
    workspace: Workspace,
    *,
    param: Tensor | None = None,
    out: Tensor | None = None,
) -> None:
    """Update the moments in ``row_file`` at the rows of the CPU gradient ``grad``; add the
    update to ``param`` or write it, row after row, into the ``(U, W)`` buffer ``out``.

    The compiled kernel does it when it is available for the dtype and layout, else torch."""
    moments = row_file.moments  # None in a compact layout: the torch path does those
    fusable = moments is not None and moments.dtype in native.RowKernel.dtypes
    kernel = native.load() if fusable and (param is None or _rows_contiguous(param)) else None
    if kernel is not None:
        fused_sparse_adam_rows_(kernel, moments, RowGroups.from_sparse(grad), adam, workspace, param=param, out=out)
        return
    rows, summed = coalesce_rows(grad)
    if param is not None:

        def apply(begin: int, chunk_rows: Tensor, update: Tensor) -> None:
            # rows are unique: gather, add, put back (cheaper on CPU than index_add_)
            update = update.view(chunk_rows.numel(), *param.shape[1:])
            param.index_put_((chunk_rows,), param.index_select(0, chunk_rows).add_(update))

    else:

        def apply(begin: int, chunk_rows: Tensor, update: Tensor) -> None:
            out[begin : begin + chunk_rows.numel()].copy_(update)

    if moments is None:
        compact_adam_rows_(row_file.m, row_file.v, rows, summed, apply, adam)
    else:
        sparse_adam_rows_(moments, rows, summed, apply, adam, workspace)


def _rows_contiguous(t: Tensor) -> bool:
    """Whether each row ``t[r]`` is one contiguous block (what the kernel addresses)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


MAX_NAME = 200  # a file key, so that "<key>.rows.pending" stays under NAME_MAX (255)


def _file_key(name: str) -> str:
    if len(name) > MAX_NAME:
        raise StateError(
            f"parameter name '{name[:40]}...' has {len(name)} characters; its row file name would be "
            f"too long (at most {MAX_NAME})",
            hint="pass a shorter name in the (name, tensor) pairs",
        )
    key = _UNSAFE.sub("_", name)
    return "_" + key if not key or key.startswith(".") else key


def _check_hyperparameters(lr, betas, eps) -> None:
    """torch's checks and words, plus: non-finite values are refused."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 < lr < math.inf:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 < eps < math.inf:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas} (two values are needed)")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")


def _check_params(groups: list[dict], indices, *, compact: bool = False) -> None:
    """SparseAdam's parameter checks, in its words, plus what a row file needs."""
    sparse, complex_, bad = [], [], []
    for index, group in zip(indices, groups):
        for d_index, p in enumerate(group["params"]):
            if p.is_sparse:
                sparse.append([index, d_index])
            elif p.is_complex():
                complex_.append([index, d_index])
            elif dtype_name(p.dtype) not in DTYPES or p.dim() == 0:
                bad.append(f"[{index}, {d_index}] ({p.dtype}, shape {list(p.shape)})")
            elif table_of(p) is not None and compact:
                raise ValueError(
                    f"Param at index [{index}, {d_index}] is the weight of table '{table_of(p).path}', whose "
                    "records hold full-precision moments; first_moment/second_moment apply to "
                    "nn.Embedding parameters only"
                )
            elif table_of(p) is not None and not table_of(p).writable:
                raise ValueError(
                    f"Param at index [{index}, {d_index}] is the weight of table '{table_of(p).path}', "
                    "opened read-only; open it writable to train it"
                )
    if sparse:
        raise ValueError(f"Sparse params at indices {sparse}: SparseAdam requires dense parameter tensors")
    if complex_:
        raise ValueError(f"Complex params at indices {complex_}: SparseAdam does not support complex parameters")
    if bad:
        raise ValueError(
            f"Params at indices {', '.join(bad)}: DiskSparseAdam needs floating-point "
            f"({', '.join(DTYPES)}) parameters with at least one dimension (the rows)"
        )


def _check_grad(p: Tensor, key: str) -> None:
    grad = p.grad
    if not grad.is_sparse:
        raise RuntimeError(
            "SparseAdam does not support dense gradients, please consider Adam instead "
            f"(DiskSparseAdam parameter '{key}' got a dense gradient; build its embedding "
            "with sparse=True)"
        )
    if grad.sparse_dim() != 1 or grad.shape != p.shape:
        raise RuntimeError(
            f"DiskSparseAdam parameter '{key}' of shape {list(p.shape)} got a sparse gradient of "
            f"shape {list(grad.shape)} with {grad.sparse_dim()} sparse dimensions; it updates "
            "whole rows and needs one sparse dimension (as nn.Embedding(sparse=True) produces)"
        )
    rows = grad._indices()
    if rows.numel() and (rows.min() < 0 or rows.max() >= p.shape[0]):
        # torch does not check a hand-made sparse tensor's indices; the row files must not
        # be written out of bounds.
        raise IndexError(
            f"DiskSparseAdam parameter '{key}' has {p.shape[0]} rows, but its sparse gradient "
            f"touches rows {rows.min().item()} to {rows.max().item()}"
        )


def _flush_and_close_unattended(store: StateDirectory) -> None:
    """The finalizer of an optimizer never closed: flush and unlock as it is dropped or the
    interpreter exits. No caller is left to raise to, and a traceback printed at exit
    ("Exception ignored in: <finalize object ...>") helps no one: a failure (its directory
    removed, a full disk) is one warning line on stderr, and the directory stays unclean."""
    try:
        _flush_and_close(store)
    except Exception as e:
        said = (getattr(e, "message", None) or str(e) or type(e).__name__).splitlines()[0]
        try:
            sys.stderr.write(
                f"dsa-train: warning: DiskSparseAdam was never closed, and flushing it at exit (or as it was dropped) failed: {said}\n"
            )
            sys.stderr.flush()
        except Exception:  # stderr already closed: nothing left to tell
            pass


def _flush_and_close(store: StateDirectory) -> None:
    """Flush (unless a step broke half-way: then the directory stays unclean) and unlock."""
    try:
        if store.broken is None:
            store.flush()
    finally:
        store.close()
