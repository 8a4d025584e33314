"""Loss curves from metric records: one run or several overlaid, and mean ± std bands over seeds.

The x axis counts epochs trained (epoch record ``e`` sits at ``e + 1``), so a teleport scheduled
before epoch ``e`` sits at ``x = e``, drawn as a dotted vertical line in the run's colour. With
``x="seconds"`` it is wall-clock time instead: an epoch record sits at its cumulative ``seconds``
(teleport included) and a teleport before epoch ``e`` where epoch ``e - 1`` ended (0 before the first),
the time it took shaded. ``x="both"`` (the default of ``plot_curves``): train loss against epochs and
against seconds side by side, then test loss against epochs: what teleport saves in epochs and what it
costs in time, in one figure.
Uses matplotlib's object API (no pyplot state): safe in threads and in workers without a display.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, MaxNLocator

Records = list[dict[str, Any]]
PANELS = (("train_loss", "train loss"), ("test_loss", "test loss"))
X_AXES = {"epoch": "epochs trained", "seconds": "wall-clock seconds (teleport included, shaded)"}
BOTH = (("train_loss", "train loss", "epoch"), ("train_loss", "train loss", "seconds"),
        ("test_loss", "test loss", "epoch"))


def read_metrics(path: str | Path) -> Records:
    """The records of a ``metrics.jsonl`` file, in order (blank lines skipped)."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_x(x: str, both: bool = False) -> None:
    if x not in X_AXES and not (both and x == "both"):
        raise ValueError(f"x={x!r}: the x axis is 'epoch' or 'seconds'" + (" (or 'both')" if both else ""))


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


def epoch_series(records: Records, key: str, x: str = "epoch") -> tuple[np.ndarray, np.ndarray]:
    """(epochs trained or cumulative seconds, values) of ``key`` over the epoch records, finite values only."""
    _check_x(x)
    pts = [(r["epoch"] + 1 if x == "epoch" else float(r["seconds"]), float(r[key])) for r in records
           if r.get("kind") == "epoch" and _number(r.get(key)) and (x == "epoch" or _number(r.get("seconds")))]
    xs, ys = zip(*pts, strict=True) if pts else ((), ())
    return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)


def teleport_epochs(records: Records) -> list[int]:
    return sorted({int(r["epoch"]) for r in records if r.get("kind") == "teleport"})


def teleport_xs(records: Records, x: str = "epoch") -> list[float]:
    """Where each teleport epoch starts: ``e`` epochs trained, or the seconds at which epoch ``e - 1`` ended."""
    _check_x(x)
    if x == "epoch":
        return [float(e) for e in teleport_epochs(records)]
    ends = [(r["epoch"], float(r["seconds"])) for r in records
            if r.get("kind") == "epoch" and _number(r.get("seconds"))]
    return [max((s for ep, s in ends if ep < e), default=0.0) for e in teleport_epochs(records)]


def teleport_spans(records: Records) -> list[tuple[float, float]]:
    """(start, end) in wall-clock seconds of each epoch's teleport: from where the epoch before ended, for the
    growth of the cumulative ``teleport_seconds`` that epoch's record shows."""
    spans, prev_s, prev_t = [], 0.0, 0.0
    for r in records:
        if r.get("kind") != "epoch" or not _number(r.get("seconds")):
            continue
        tele = float(r["teleport_seconds"]) if _number(r.get("teleport_seconds")) else prev_t
        if tele > prev_t:
            spans.append((prev_s, prev_s + tele - prev_t))
        prev_s, prev_t = float(r["seconds"]), tele
    return spans


class PlainLogFormatter(LogFormatter):
    """Log-axis labels as plain numbers (0.3, 2) rather than 3e-01; which ticks get labels is unchanged."""

    def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
        return f"{x:g}"


def _color(i: int) -> str:
    return f"C{i % 10}"


def _finish(ax: Axes, ylabel: str, values: Sequence[np.ndarray], x: str = "epoch") -> None:
    """Log y when the values are positive and span over 3x (losses), labels, grid, legend if labelled."""
    flat = np.concatenate([v for v in values if v.size]) if any(v.size for v in values) else np.array([])
    if flat.size and (flat > 0).all() and flat.max() > 3 * flat.min():
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(PlainLogFormatter())
        ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=x == "epoch"))
    ax.set_xlabel(X_AXES[x])
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _mark_teleports(ax: Axes, xs: Sequence[float], color: str, label: str | None) -> None:
    for j, e in enumerate(xs):
        ax.axvline(e, color=color, linestyle=":", linewidth=1.0, alpha=0.6, label=label if j == 0 else None)


def plot_curves(runs: dict[str, Records], path: str | Path | BinaryIO, title: str | None = None,
                fmt: str | None = None, x: str = "both") -> Path | BinaryIO:
    """Train and test loss vs epochs trained, wall-clock ``seconds`` or ``both`` (log y) for each run, teleports
    marked; a last panel shows ‖∇L‖² on the teleport batches before and after each teleport when there are any."""
    fig = curves_figure(runs, title, x)
    fig.savefig(path, dpi=110, format=fmt)
    return path if hasattr(path, "write") else Path(path)


def curves_figure(runs: dict[str, Records], title: str | None = None, x: str = "both") -> Figure:
    """The figure ``plot_curves`` saves."""
    _check_x(x, both=True)
    tele = {label: [r for r in recs if r.get("kind") == "teleport"] for label, recs in runs.items()}
    has_tele = any(tele.values())
    panels = BOTH if x == "both" else tuple((key, name, x) for key, name in PANELS)
    fig = Figure(figsize=(5.0 * (len(panels) + has_tele), 4.0), layout="constrained")
    axes = fig.subplots(1, len(panels) + has_tele)
    for ax, (key, name, on) in zip(axes, panels, strict=False):
        _loss_panel(ax, runs, key, name, on, legend=key == "train_loss" and on == "epoch")
    if has_tele:
        _grad_norm_panel(axes[-1], tele)
    if title:
        fig.suptitle(title)
    return fig


def _loss_panel(ax: Axes, runs: dict[str, Records], key: str, name: str, x: str, legend: bool) -> None:
    plotted = []
    for i, (label, recs) in enumerate(runs.items()):
        xs, ys = epoch_series(recs, key, x)
        ax.plot(xs, ys, color=_color(i), marker="o", markersize=3, linewidth=1.6, label=label)
        _mark_teleports(ax, teleport_xs(recs, x), _color(i), f"teleports ({label})" if legend else None)
        if x == "seconds":
            for start, end in teleport_spans(recs):
                ax.axvspan(start, end, color=_color(i), alpha=0.15, linewidth=0)
        plotted.append(ys)
    _finish(ax, name, plotted, x)


def _grad_norm_panel(ax: Axes, tele: dict[str, Records]) -> None:
    plotted = []
    for i, (label, recs) in enumerate(tele.items()):
        if not recs:
            continue
        k = np.arange(len(recs))
        before = np.array([r["grad_norm_sq_before"] for r in recs], dtype=float)
        after = np.array([r["grad_norm_sq_after"] for r in recs], dtype=float)
        ax.plot(k, before, color=_color(i), linestyle="--", marker=".", alpha=0.6, label=f"{label}: before")
        ax.plot(k, after, color=_color(i), marker="^", markersize=4, label=f"{label}: after")
        plotted += [before[np.isfinite(before)], after[np.isfinite(after)]]
    _finish(ax, "‖∇L‖² on the teleport batch", plotted)
    ax.set_xlabel("teleport batch (in order)")


def band(runs: list[Records], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(epochs, mean, std) of ``key`` over seeds, on the epochs every seed reached."""
    series = [dict(zip(*epoch_series(recs, key), strict=True)) for recs in runs]
    common = sorted(set.intersection(*(set(s) for s in series))) if series else []
    if not common:
        return np.array([]), np.array([]), np.array([])
    values = np.array([[s[e] for e in common] for s in series], dtype=float).reshape(len(series), len(common))
    return np.asarray(common, dtype=float), values.mean(axis=0), values.std(axis=0)


def plot_bands(groups: dict[str, list[Records]], path: str | Path | BinaryIO, title: str | None = None,
               fmt: str | None = None) -> Path | BinaryIO:
    """Mean ± std over seeds of train and test loss for each group (the paper's figure style)."""
    fig = Figure(figsize=(10.0, 4.0), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, (key, name) in zip(axes, PANELS, strict=True):
        plotted = []
        for i, (label, runs) in enumerate(groups.items()):
            xs, mean, std = band(runs, key)
            if not xs.size:
                continue
            lower = np.maximum(mean - std, mean * 1e-3)  # stays positive for the log scale
            ax.fill_between(xs, lower, mean + std, color=_color(i), alpha=0.25, linewidth=0)
            ax.plot(xs, mean, color=_color(i), linewidth=1.8, label=f"{label} (n={len(runs)})")
            _mark_teleports(ax, teleport_epochs(runs[0]), _color(i), None)
            plotted += [lower, mean + std]
        _finish(ax, f"{name} (mean ± std)", plotted)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110, format=fmt)
    return path if hasattr(path, "write") else Path(path)
