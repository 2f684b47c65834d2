"""Embedding modules whose weight lives in a memory-mapped file: tables larger than RAM.

:class:`DiskEmbedding` and :class:`DiskEmbeddingBag` are ``nn.Embedding(sparse=True)`` and
``nn.EmbeddingBag(sparse=True)`` whose ``weight`` is a view of a table file on the host (see
:mod:`dsa_train.storage.table`): the forward pass gathers only the looked-up rows and moves
them to the module's device, the backward pass yields the usual sparse gradient on the host,
and :class:`~dsa_train.DiskSparseAdam` keeps the moments in the same row records. Only the
pages of touched rows ever occupy memory, so neither RAM nor VRAM bounds the table.

:class:`ChainEmbedding` is a checkpoint's version of a table kept as deltas, read-only and
read through its chain (see :mod:`dsa_train.storage.deltas`), never written out: what
evaluation scores with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .storage.deltas import ChainReader
from .storage.format import TABLE_LAYOUT, RowSpec, parse_row_header
from .optim.prefetch import shared_prefetcher
from .storage.row_file import DTYPES
from .storage.table import Table, register_weight

STATE_KEY = "table"  # a disk module's state_dict entry: a reference to its table, not N x D weights


class DiskTable(nn.Module):
    """What both disk modules share: the table, its weight parameter, the output device, and
    the arguments that make them (see :class:`DiskEmbedding`)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        path: str | Path,
        init: str = "normal",
        std: float = 1.0,
        bound: float = 0.1,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        writable: bool = True,
        progress: Callable[[int, int], None] | None = None,
        first_row: int = 0,
        total_rows: int | None = None,
    ) -> None:
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(
                f"num_embeddings and embedding_dim must be positive, got {num_embeddings} and {embedding_dim}"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        path = Path(path)
        shape = (num_embeddings, embedding_dim)
        if path.exists():
            self.table = Table.open(path, shape, dtype, writable=writable)
        else:
            self.table = Table.create(
                path,
                shape,
                dtype,
                name=path.stem,
                init=init,
                std=std,
                bound=bound,
                seed=seed,
                progress=progress,
                first_row=first_row,
                total_rows=total_rows,
            )
            if not writable:
                self.table.close()
                self.table = Table.open(path, shape, dtype, writable=False)
        self.weight = nn.Parameter(self.table.weight, requires_grad=writable)
        register_weight(self.weight, self.table)  # how DiskSparseAdam finds the records
        self.output_device = torch.device(device) if device is not None else torch.device("cpu")

    def __deepcopy__(self, memo):
        raise TypeError(
            f"{type(self).__name__} cannot be deep-copied: its weight is the memory-mapped table file "
            f"'{self.table.path}', which a copy in memory would not be. Copy the file (after the optimizer's flush()) and "
            f"open a new {type(self).__name__} on the copy, or copy the rest of the model without this module"
        )

    @property
    def path(self) -> Path:
        return self.table.path

    def _apply(self, fn, recurse=True):
        # .to(device) / .cuda() move where outputs go; the weight stays in its file.
        weight = self._parameters.pop("weight")
        try:
            super()._apply(fn, recurse)
            self.output_device = fn(torch.empty(0)).device
        finally:
            self._parameters["weight"] = weight
        return self

    def prefetch(self, indices: Tensor) -> None:
        """Start reading these rows' records into the page cache (returns at once).

        Call it with the next batch's indices before this batch's step: the reads overlap
        the step's compute. It only warms the cache, so it can never make a row stale. A
        trainable table's pages are also made writable, ready for the optimizer's update.
        """
        shared_prefetcher().submit(self.table.rows, indices, claim=self.weight.requires_grad)

    def flush(self) -> None:
        """Make the weights on disk durable (``DiskSparseAdam.flush`` does it for the moments)."""
        self.table.flush()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # A reference, not the N x D weights: copy the table file to back it up.
        destination[prefix + STATE_KEY] = {
            "path": str(self.table.path.resolve()),
            "table_id": self.table.table_id,
            "shape": [self.num_embeddings, self.embedding_dim],
        }

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        weight, ref = state_dict.get(prefix + "weight"), state_dict.get(prefix + STATE_KEY)
        if weight is not None:  # e.g. an nn.Embedding's weights: copied into the table, in chunks
            if tuple(weight.shape) != tuple(self.weight.shape):
                error_msgs.append(
                    f"size mismatch for {prefix}weight: {tuple(weight.shape)} vs table {tuple(self.weight.shape)}"
                )
                return
            with torch.no_grad():
                for begin in range(0, self.num_embeddings, 1 << 16):
                    self.weight[begin : begin + (1 << 16)].copy_(weight[begin : begin + (1 << 16)])
                    self.table.rows.write_out_rows(begin, begin + (1 << 16))  # memory holds one chunk, not the table
        elif ref is None:
            missing_keys.append(prefix + STATE_KEY)
        elif ref.get("table_id") != self.table.table_id:
            error_msgs.append(
                f"{prefix}{STATE_KEY}: the state_dict refers to table '{ref.get('path')}' (id {ref.get('table_id')}), "
                f"this module's is '{self.table.path}' (id {self.table.table_id}); restore that table file"
            )
        for key in state_dict:
            if (
                key.startswith(prefix)
                and key[len(prefix) :] not in ("weight", STATE_KEY)
                and "." not in key[len(prefix) :]
            ):
                unexpected_keys.append(key)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, path='{self.table.path}'"


class DiskEmbedding(DiskTable):
    r"""``nn.Embedding(num_embeddings, embedding_dim, sparse=True)`` with its weight on disk.

    The weight is a memory-mapped table file at ``path`` (created if missing, reopened with
    its trained weights if present). Its rows are initialised chunk by chunk, never as one
    tensor: ``init="normal"`` draws :math:`\mathcal N(0, \text{std}^2)` (``std=1`` is
    ``nn.Embedding``'s default), ``"uniform"`` :math:`U(-\text{bound}, \text{bound})`,
    ``"xavier_uniform"`` :math:`U(-a, a)`, :math:`a = \sqrt{6 / (N + D)}`, ``"zeros"``; each
    chunk of 65,536 rows from its own generator seeded by ``seed``, so a table's initial
    weights depend on its seed only. With ``total_rows``, the table is rows
    ``[first_row, first_row + num_embeddings)`` of a ``total_rows``-row table drawn that way
    (one process's shard of a table sharded over several).

    ``forward(indices)`` returns ``weight[indices]`` on ``device`` (set by the argument or by
    ``.to(device)``; the weight itself never leaves the host); ``backward`` gives the weight a
    sparse gradient, as ``sparse=True`` does. Train it with :class:`~dsa_train.DiskSparseAdam`
    (moments in the same records) or any optimizer that takes sparse gradients.

    ``state_dict()`` holds a reference to the table (path and id), not its ``N x D`` weights,
    which may be larger than RAM; copy the file to back it up. Loading a state dict with a
    ``weight`` (an ``nn.Embedding``'s) copies it into the table.

    Example::

        emb = DiskEmbedding(50_000_000, 64, path="/ssd/entities.table", std=0.01).to("cuda")
        opt = DiskSparseAdam(emb.named_parameters(), lr=1e-3, state_dir="/ssd/opt")
    """

    def forward(self, indices: Tensor) -> Tensor:
        rows = F.embedding(indices.to("cpu"), self.weight, sparse=True)
        return rows.to(self.output_device, non_blocking=True)


class DiskEmbeddingBag(DiskTable):
    """``nn.EmbeddingBag(num_embeddings, embedding_dim, mode=mode, sparse=True)`` with its
    weight on disk; everything else as :class:`DiskEmbedding`.

    The forward pass gathers each looked-up row (``F.embedding``, whose backward is the
    sparse gradient) and pools the gathered rows: ``F.embedding_bag`` on the table itself
    would first copy the whole weight, a strided view of the records, into a contiguous
    tensor, reading every row of the file at every step. The gradient is the one
    ``nn.EmbeddingBag`` gives, value for value: one row per lookup, scaled by its weight
    (``sum``) or its bag's size (``mean``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mode: str = "mean", **table_options) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode has to be one of sum, mean or max, got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, **table_options)
        self.mode = mode

    def forward(
        self, indices: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        cpu = lambda t: None if t is None else t.to("cpu")  # noqa: E731
        indices = indices.to("cpu")
        if indices.dim() == 2:  # fixed-size bags, one per row, as nn.EmbeddingBag takes them
            offsets = (
                torch.arange(0, indices.numel(), indices.shape[1])
                if indices.shape[1]
                else torch.zeros(len(indices), dtype=torch.long)
            )
            indices = indices.reshape(-1)
            per_sample_weights = None if per_sample_weights is None else per_sample_weights.reshape(-1)
        gathered = F.embedding(indices, self.weight, sparse=True)
        bags = F.embedding_bag(
            torch.arange(len(indices)),
            gathered,
            cpu(offsets),
            mode=self.mode,
            per_sample_weights=cpu(per_sample_weights),
        )
        return bags.to(self.output_device, non_blocking=True)


class TableRows:
    """The weight rows of a :class:`ChainEmbedding`, read when indexed: ``rows[ids]`` is
    ``weight[ids]`` (a tensor of any shape of ids; each distinct row read once), so evaluation
    that reads a sample of rows reads only those. ``cpu()`` is itself (it lives on the host)."""

    def __init__(self, reader: ChainReader, spec: RowSpec) -> None:
        self.reader, self.spec = reader, spec
        self.dtype = DTYPES[spec.dtype]
        self.shape = torch.Size(spec.shape)
        self._weight_bytes = spec.row_width * self.dtype.itemsize

    def __len__(self) -> int:
        return self.spec.num_rows

    def __getitem__(self, ids: Tensor) -> Tensor:
        ids = torch.as_tensor(ids)
        records = self.reader.gather(ids.reshape(-1).cpu().numpy())
        return self._weights(records).view(*ids.shape, self.spec.row_width)

    def range(self, start: int, stop: int) -> Tensor:
        """Rows ``[start, stop)`` (one read of the base)."""
        return self._weights(self.reader.read(start, stop))

    def cpu(self) -> TableRows:
        return self

    def _weights(self, records: np.ndarray) -> Tensor:
        raw = torch.from_numpy(np.ascontiguousarray(records[:, : self._weight_bytes]))
        return raw.view(self.dtype)


class ChainEmbedding(nn.Module):
    """A checkpoint's version of a disk table (see :class:`DiskEmbedding`), read-only, read
    through its chain: the base's records (a file, or the table drawn again from its seed,
    chunk by chunk) with the deltas' laid over them, nothing written.

    ``forward(indices)`` returns ``weight[indices]`` on the module's device, as
    :class:`DiskEmbedding` does (without a gradient); ``rows[ids]`` reads weight rows on demand
    (:class:`TableRows`); ``weight`` is the whole ``N x D`` weight, read into RAM chunk by
    chunk on first use, for users that need every row at once (full-batch GraphSAGE). Its
    state dict is the same reference to the table a :class:`DiskEmbedding` saves, and loading
    one checks the table id against the version's header.
    """

    CHUNK_ROWS = 1 << 16

    def __init__(self, reader: ChainReader, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        meta = parse_row_header(reader.header(), f"the table version of '{reader.chain[-1]}'")
        self.spec = RowSpec(meta["name"], tuple(meta["shape"]), meta["dtype"], meta["state_id"], TABLE_LAYOUT)
        if meta.get("layout") != TABLE_LAYOUT or len(self.spec.shape) != 2 or reader.row_bytes != self.spec.row_bytes:
            raise ValueError(f"'{reader.chain[-1]}' is not a version of a 2-d disk table")
        self.num_embeddings, self.embedding_dim = self.spec.shape
        self.rows = TableRows(reader, self.spec)
        self._weight: Tensor | None = None
        self.output_device = torch.device(device) if device is not None else torch.device("cpu")

    @property
    def table_id(self) -> str:
        return self.spec.state_id

    @property
    def weight(self) -> Tensor:
        if self._weight is None:
            weight = torch.empty(self.rows.shape, dtype=self.rows.dtype)
            for begin in range(0, self.num_embeddings, self.CHUNK_ROWS):
                stop = min(begin + self.CHUNK_ROWS, self.num_embeddings)
                weight[begin:stop] = self.rows.range(begin, stop)
            self._weight = weight
        return self._weight

    def forward(self, indices: Tensor) -> Tensor:
        return self.rows[indices].to(self.output_device, non_blocking=True)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.output_device = fn(torch.empty(0)).device  # outputs move; the table stays where it is
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        where = str(self.rows.reader.chain[-1])
        destination[prefix + STATE_KEY] = {"path": where, "table_id": self.table_id, "shape": list(self.spec.shape)}

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        ref = state_dict.get(prefix + STATE_KEY)
        if ref is None:
            missing_keys.append(prefix + STATE_KEY)
        elif ref.get("table_id") != self.table_id:
            error_msgs.append(
                f"{prefix}{STATE_KEY}: the state_dict refers to table '{ref.get('path')}' (id {ref.get('table_id')}), "
                f"this version is of table id {self.table_id} ('{self.rows.reader.chain[-1]}')"
            )
        for key in state_dict:
            if key.startswith(prefix) and key[len(prefix) :] != STATE_KEY and "." not in key[len(prefix) :]:
                unexpected_keys.append(key)

    def close(self) -> None:
        self.rows.reader.close()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, chain='{self.rows.reader.chain[-1]}'"
