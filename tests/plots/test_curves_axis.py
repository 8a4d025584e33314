"""plots.curves on either x axis: epochs trained or wall-clock seconds (teleport included), teleports marked on both."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

from plots.curves import X_AXES, curves_figure, epoch_series, plot_curves, teleport_xs

TELEPORTS = (0, 2)  # teleport before epochs 0 and 2


def run(scale: float, seconds_per_epoch: float, teleport_cost: float) -> list[dict[str, Any]]:
    """Epoch records as workers/train/loop.py writes them: cumulative seconds include the teleports' time."""
    out: list[dict[str, Any]] = []
    t = 0.0
    for e in range(5):
        if e in TELEPORTS:
            out.append({"kind": "teleport", "epoch": e, "batch": 0, "grad_norm_sq_before": 1.0 + e,
                        "grad_norm_sq_after": 3.0 + e})
            t += teleport_cost
        t += seconds_per_epoch * (1 + 0.1 * e)
        out.append({"kind": "epoch", "epoch": e, "train_loss": scale / (e + 1), "test_loss": scale / (e + 2),
                    "seconds": t, "teleport_seconds": teleport_cost * sum(1 for k in TELEPORTS if k <= e)})
    return out


def epochs(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in recs if r["kind"] == "epoch"]


def test_series_and_teleport_marks_on_either_axis() -> None:
    recs = run(1.0, 0.5, 0.3)
    xs, ys = epoch_series(recs, "train_loss")
    assert xs.tolist() == [r["epoch"] + 1 for r in epochs(recs)]
    xs_s, ys_s = epoch_series(recs, "train_loss", "seconds")
    assert xs_s.tolist() == [r["seconds"] for r in epochs(recs)] and ys_s.tolist() == ys.tolist()
    assert np.all(np.diff(xs_s) > 0)
    assert teleport_xs(recs) == [0.0, 2.0]  # e epochs trained before the teleport at epoch e
    by_epoch = {r["epoch"]: r["seconds"] for r in epochs(recs)}
    assert teleport_xs(recs, "seconds") == [0.0, by_epoch[1]]  # when the epoch before it ended
    with pytest.raises(ValueError, match="x='steps'"):
        epoch_series(recs, "train_loss", "steps")


def test_seconds_figure_plots_each_runs_seconds_and_marks_its_teleports() -> None:
    runs = {"teleport": run(1.0, 0.5, 0.8), "plain": [r for r in run(2.0, 0.4, 0.0) if r["kind"] == "epoch"]}
    fig = curves_figure(runs, x="seconds")
    loss_axes = fig.axes[:2]
    for ax, key in zip(loss_axes, ("train_loss", "test_loss"), strict=True):
        assert ax.get_xlabel() == X_AXES["seconds"]
        curves = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
        marks = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
        for line, recs in zip(curves, runs.values(), strict=True):
            assert list(line.get_xdata()) == [r["seconds"] for r in epochs(recs)]
            assert list(line.get_ydata()) == [r[key] for r in epochs(recs)]
        assert sorted(m.get_xdata()[0] for m in marks) == teleport_xs(runs["teleport"], "seconds")
    buf = io.BytesIO()
    plot_curves(runs, buf, fmt="png", x="seconds")
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_the_default_figure_shows_epochs_and_seconds_side_by_side_with_teleport_time_shaded() -> None:
    from plots.curves import teleport_spans

    recs = run(1.0, 0.5, 0.8)
    by_epoch = {r["epoch"]: r["seconds"] for r in epochs(recs)}
    spans = teleport_spans(recs)
    assert spans == [(0.0, pytest.approx(0.8)), (by_epoch[1], pytest.approx(by_epoch[1] + 0.8))]
    assert teleport_spans([r for r in run(2.0, 0.4, 0.0) if r["kind"] == "epoch"]) == []
    fig = curves_figure({"teleport": recs})
    train_e, train_s, test_e, grad = fig.axes
    assert [ax.get_xlabel() for ax in (train_e, train_s, test_e)] == [X_AXES["epoch"], X_AXES["seconds"],
                                                                     X_AXES["epoch"]]
    assert (train_e.get_ylabel(), train_s.get_ylabel(), test_e.get_ylabel()) == ("train loss", "train loss",
                                                                               "test loss")
    shaded = [p.get_x() for p in train_s.patches]  # axvspan rectangles: one per teleport, where it began
    assert shaded == pytest.approx([a for a, _ in spans])
    assert not train_e.patches and "‖∇L‖²" in grad.get_ylabel()
    with pytest.raises(ValueError, match="or 'both'"):
        curves_figure({"teleport": recs}, x="steps")
