"""Curves a person can look at: ``dsa-train plot`` draws runs and tune folders with matplotlib.

A run folder gives, from its metrics.jsonl (the source of truth), the training loss and the
learning rate against steps (the ``train`` records) and each evaluation's headline metrics
against steps (MRR and Hits@10 of both query sides, probe or classifier accuracy, link or click
AUC; one line per split), several runs overlaid in one colour each. A tune folder gives its
trials: each trial's valid metric against its trial number (pruned ones where they stopped,
with the best so far), and each trial's valid curve against epochs, pruned ones dashed.

matplotlib is an optional dependency (``pip install 'dsa-train[plot]'``); figures are drawn on
a :class:`matplotlib.figure.Figure` (no pyplot state) and written atomically.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DsaError, StateError
from .fsutil import atomic_write_bytes, read_json_object
from .runs.run_folder import MetricsLog, RunFolder

#: The metrics drawn from an evaluation: (group, metric) -> panel title. Only these, so a
#: knowledge graph's eval gives two panels, not fifteen.
HEADLINES = {
    ("both", "mrr"): "MRR",
    ("both", "hits_at_10"): "Hits@10",
    ("ogb", "mrr"): "OGB MRR",  # eval.protocol: ogb or both
    ("classifier", "accuracy"): "classifier accuracy",
    ("probe", "accuracy"): "probe accuracy",
    ("link", "auc"): "link AUC",
    ("link", "mrr"): "link MRR",
    ("clicks", "auc"): "click AUC",
}
FORMATS = (".png", ".svg", ".pdf")


@dataclass
class Curves:
    """What one run's metrics.jsonl holds, as (steps, values) series."""

    name: str
    loss: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    lr: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    evals: dict[tuple[str, str], tuple[list[int], list[float]]] = field(
        default_factory=dict
    )  # (panel title, split) -> series


def read_curves(run: Path, name: str | None = None) -> Curves:
    """A run folder's curves (see the module's docstring)."""
    folder = RunFolder.find(run)
    curves = Curves(name or folder.path.name)
    records = MetricsLog.read(folder.metrics_path) if folder.metrics_path.is_file() else []
    for record in records:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        if record.get("kind") == "train":
            _add(curves.loss, step, record.get("loss"))
            _add(curves.lr, step, record.get("lr"))
        elif record.get("kind") == "eval":
            for (group, metric), title in HEADLINES.items():
                value = record.get(group, {}).get(metric) if isinstance(record.get(group), dict) else None
                if _finite(value):
                    _add(curves.evals.setdefault((title, record.get("split", "?")), ([], [])), step, value)
    return curves


def _add(series: tuple[list, list], step: int, value) -> None:
    if _finite(value):
        series[0].append(step)
        series[1].append(float(value))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise DsaError(
            "dsa-train plot draws with matplotlib, which is not installed",
            hint="pip install 'dsa-train[plot]' (or matplotlib)",
        ) from None
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    return Figure


def is_tune_folder(path: Path) -> bool:
    from .tune.study import TUNE_FORMAT, TuneFolder

    marker = read_json_object(Path(path) / TuneFolder.MARKER)
    return marker is not None and marker.get("format") == TUNE_FORMAT


def figure(paths: list[Path]):
    """One figure for these run and tune folders: their panels on a grid of two columns."""
    Figure = _matplotlib()
    runs = [read_curves(p) for p in paths if not is_tune_folder(p)]
    tunes = [p for p in paths if is_tune_folder(p)]
    panels = _run_panels(runs) + [panel for tune in tunes for panel in _tune_panels(Path(tune))]
    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(6.4 * columns, 3.6 * rows), layout="constrained")
    for i, (title, draw) in enumerate(panels):
        ax = fig.add_subplot(rows, columns, i + 1)
        ax.set_title(title)
        draw(ax)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return fig


def _run_panels(runs: list[Curves]) -> list:
    if not runs:
        return []
    colours = [f"C{i % 10}" for i in range(len(runs))]

    def series(ax, pick, *, log: bool = False) -> None:
        for run, colour in zip(runs, colours):
            steps, values = pick(run)
            if steps:
                ax.plot(steps, values, color=colour, label=run.name)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")

    panels = [("training loss", lambda ax: series(ax, lambda r: r.loss))]
    if any(r.lr[0] for r in runs):
        panels.append(("learning rate", lambda ax: series(ax, lambda r: r.lr)))
    titles = list(dict.fromkeys(title for r in runs for title, _ in r.evals))
    for title in titles:

        def draw(ax, title=title) -> None:
            for run, colour in zip(runs, colours):
                for (panel, split), (steps, values) in run.evals.items():
                    if panel == title:
                        ax.plot(
                            steps,
                            values,
                            color=colour,
                            marker="o",
                            linestyle="-" if split == "valid" else "--",
                            label=f"{run.name} ({split})",
                        )
            ax.set_xlabel("step")

        panels.append((title, draw))
    return panels


def _tune_panels(tune: Path) -> list:
    from .tune.study import TuneFolder, read_table

    table_path = tune / TuneFolder.TABLE
    if not table_path.is_file():
        raise StateError(
            f"tune folder '{tune}' has no {TuneFolder.TABLE} yet",
            hint="it is written when a search ends; resume the search to finish it",
        )
    table = read_table(table_path)
    metric = next(iter(k for k in (table[0] if table else {}) if k.startswith("valid ")), "valid metric")
    finished = [(int(r["trial"]), float(r[metric]), r["state"]) for r in table if r.get(metric)]

    from matplotlib.ticker import MaxNLocator

    def trials(ax) -> None:
        for state, marker, colour in (("COMPLETE", "o", "C0"), ("PRUNED", "x", "C3")):
            picked = [(n, v) for n, v, s in finished if s == state]
            if picked:
                ax.scatter(*zip(*picked), marker=marker, color=colour, label=state.lower())
        best, xs, ys = -math.inf, [], []
        for n, v, s in finished:
            if s == "COMPLETE" and v > best:
                best = v
            if best > -math.inf:
                xs.append(n)
                ys.append(best)
        if xs:
            ax.step(xs, ys, where="post", color="C2", label="best so far")
        ax.set_xlabel("trial")
        ax.set_ylabel(metric)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    def curves(ax) -> None:
        for row in table:
            run = tune / "trials" / row["run"] if row.get("run") else None
            if run is None or not (run / RunFolder.METRICS).is_file():
                continue
            points = [
                (r["epoch"], v)
                for r in MetricsLog.read(run / RunFolder.METRICS)
                if r.get("kind") == "eval" and r.get("split") == "valid"
                for v in [_headline(r)]
                if v is not None
            ]
            if points:
                pruned = row["state"] == "PRUNED"
                ax.plot(
                    *zip(*points),
                    color="C3" if pruned else "C0",
                    alpha=0.6,
                    linestyle="--" if pruned else "-",
                    marker=".",
                )
        ax.set_xlabel("epoch")
        ax.set_ylabel(metric)

    name = tune.name
    return [(f"{name}: trials", trials), (f"{name}: each trial's {metric} (pruned dashed)", curves)]


def _headline(record: dict) -> float | None:
    for group, metric in HEADLINES:
        value = record.get(group, {}).get(metric) if isinstance(record.get(group), dict) else None
        if _finite(value):
            return float(value)
    return None


def save(fig, path: Path) -> None:
    """Write the figure as PNG, SVG or PDF (by the file's extension), atomically."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise DsaError(
            f"cannot write a plot as '{path.name}': the extension says no format drawn here",
            hint="end the file name in .png, .svg or .pdf",
        )
    data = io.BytesIO()
    fig.savefig(data, format=path.suffix.lower().lstrip("."), dpi=100)
    atomic_write_bytes(path, data.getvalue())
