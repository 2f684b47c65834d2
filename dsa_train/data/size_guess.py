"""Rough sizes of a dataset read from files, before it is imported: an edge list's edges and
nodes, a click log's impressions, from the files' sizes and a sample of their first lines
(never the whole file). What ``validate`` and ``run --dry-run`` estimate a run with; each
figure is an estimate, and says what it was made from.

**Edge lists.** Edges: the files' bytes over the sample's bytes per data line (parquet: the
row count its metadata holds). Nodes: the sample's distinct nodes per edge, times the edges
(a sample of the first lines meets fewer repeats than the whole file, so this errs high:
safe for a warning), at least the sample's distinct nodes, and with ``ids: integers`` at
least one past the largest id seen. **Click logs.** Impressions: the file's bytes over the
sample's bytes per line; a ``.gz`` file's bytes are scaled by the sample's compression ratio.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..recipe import DatasetConfig
from .paths import dataset_path

SAMPLE_BYTES = 1 << 20  # read from the start of a file


@dataclass(frozen=True)
class Guess:
    """An estimated size: ``items`` (edges or impressions), ``nodes`` (edge lists), and what it
    was estimated from, in a few words."""

    items: int
    nodes: int
    how: str


def edge_list_guess(config: DatasetConfig) -> Guess:
    """The edges and nodes of ``config``'s edge list (see the module docstring). Raises
    ``DatasetError`` or ``ConfigError`` where the import would (a missing or empty file)."""
    from . import edge_import, edge_parquet
    from .edge_list import edge_format, parse_integers, split_chunk
    from .fingerprint import fingerprints

    files = edge_import.edge_files(dataset_path(config, config.path))
    edges_config = config.edges
    total = sum(f.stat().st_size for f in files)
    if edge_parquet.is_parquet(files[0]):
        fmt = edge_parquet.parquet_format(files, edges_config)
        text, fields = next(
            edge_parquet.parquet_chunks(files[:1], fmt, edges_config, {"input_edges": 0, "below_min_weight": 0}, total)
        )
        edges, how = fmt.rows, f"estimated from {fmt.rows:,} rows in the parquet metadata and its first batch"
    else:
        fmt = edge_format(
            files[0],
            delimiter=edges_config.delimiter,
            comment=edges_config.comment,
            header=edges_config.header,
            source=edges_config.source,
            target=edges_config.target,
            weight=edges_config.weight,
        )
        with open(files[0], "rb") as f:
            data = f.read(SAMPLE_BYTES)
        whole = len(data) == total
        if not whole:
            data = data[: data.rfind(b"\n") + 1]
        text, fields, _, problems = split_chunk(data, fmt, fmt.columns[:2], skip_header=fmt.header)
        if problems or not len(fields):
            raise ValueError("the sample's lines do not read as edges")
        edges = len(fields) if whole else round(total * len(fields) / len(data))
        how = (
            (
                f"estimated from {len(fields):,} edges in its first {len(data):,} bytes, {total:,} bytes in all; "
                "nodes on the high side: the first lines repeat fewer nodes than the whole file"
            )
            if not whole
            else "counted in the whole file"
        )
        if edges_config.ids == "integers":
            fields, _ = parse_integers(text, fields[..., 0].ravel(), fields[..., 1].ravel())
            fields = fields.reshape(-1, 2)
    sample = len(fields)
    if edges_config.ids == "integers":
        ids = np.asarray(fields, np.int64).ravel()
        distinct, largest = len(np.unique(ids)), int(ids.max(initial=-1))
    else:
        prints = fingerprints(text, fields[..., 0].ravel(), fields[..., 1].ravel())
        distinct, largest = len(np.unique(prints[:, 0])), -1
    nodes = max(distinct, largest + 1, round(edges * distinct / max(sample, 1)))
    return Guess(edges, nodes, how)


def click_log_guess(path: Path) -> Guess:
    """The impressions (lines) of the click log at ``path`` (see the module docstring)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(SAMPLE_BYTES)
    data, scale, inflate = raw, 1.0, None
    if path.name.lower().endswith(".gz"):
        inflate = zlib.decompressobj(wbits=31)
        data = inflate.decompress(raw, 16 * SAMPLE_BYTES)
        used = len(raw) - len(inflate.unconsumed_tail) - len(inflate.unused_data)
        scale = len(data) / max(used, 1)
    whole = len(raw) == size and (inflate is None or inflate.eof)
    lines = data.count(b"\n")
    if not whole:
        data = data[: data.rfind(b"\n") + 1]
    if not lines:
        raise ValueError("no whole line in the sample")
    impressions = lines if whole else round(size * scale * lines / len(data))
    return Guess(
        impressions,
        0,
        "counted in the whole file" if whole else f"estimated from its first {lines:,} lines and its size",
    )
