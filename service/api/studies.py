"""A sweep's results: its trials table, the best trial, trials grouped over seeds, the study table and plot.

No FastAPI here; ``plots`` is imported only when a table or a figure is asked for (matplotlib is slow to load).
"""

from __future__ import annotations

import io
from typing import Any

from api_schemas import keys
from api_schemas.jobs import StudyGroup, StudyView, TrialRow
from api_schemas.sweeps import SweepSubmit
from service.core.store import Store

SEED = "training.seed"


def trial_rows(store: Store, sweep_id: str) -> list[TrialRow]:
    """The sweep's trials table as the driver last wrote it, ordered by trial id."""
    rows = [TrialRow.model_validate_json(v) for v in store.r.hgetall(keys.trials(sweep_id)).values()]
    return sorted(rows, key=lambda t: t.trial)


def best_trial(rows: list[TrialRow], mode: str) -> TrialRow | None:
    """The trial with the lowest (``mode="min"``) or highest best metric; None while no trial has one."""
    scored = [(t.best, t) for t in rows if t.best is not None]
    if not scored:
        return None
    return (min if mode == "min" else max)(scored, key=lambda pair: pair[0])[1]


def _label(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(config.items())) or "all"


def seed_groups(sweep: SweepSubmit, rows: list[TrialRow]) -> dict[str, list[TrialRow]]:
    """Trials grouped by their non-seed parameters (each trial alone when the space has no seed)."""
    groups: dict[str, list[TrialRow]] = {}
    for t in rows:
        if SEED not in sweep.search_space:
            groups[t.trial] = [t]
            continue
        groups.setdefault(_label({k: v for k, v in t.config.items() if k != SEED}), []).append(t)
    return groups


def study_view(sweep_id: str, sweep: SweepSubmit, rows: list[TrialRow]) -> StudyView:
    """Per seed group: the final metrics' mean ± std over seeds, and the paper-style comparison table."""
    from plots.tables import compare_table, group_stats

    groups = seed_groups(sweep, rows)
    seeds = max((len(ts) for ts in groups.values()), default=0)
    target = sweep.base.training.target_loss
    runs = {label: [t.summary for t in ts] for label, ts in groups.items()}
    return StudyView(
        id=sweep_id, seeds=seeds, target_loss=target,
        groups=[StudyGroup(label=label, config={k: v for k, v in ts[0].config.items() if k != SEED},
                           trials=[t.trial for t in ts], stats=group_stats(runs[label]), runs=runs[label])
                for label, ts in groups.items()],
        table=compare_table(runs, seeds, target) if groups else "(no trial has reported yet)")


def sweep_png(sweep_id: str, sweep: SweepSubmit, recs: list[dict[str, Any]], rows: list[TrialRow]) -> bytes:
    """Every trial's curves; with ``training.seed`` in the space, mean ± std bands per seed group."""
    from plots.curves import plot_bands, plot_curves

    by_trial: dict[str, list[dict[str, Any]]] = {}
    for rec in recs:
        if rec.get("trial"):
            by_trial.setdefault(rec["trial"], []).append(rec)
    rows = [t for t in rows if t.trial in by_trial]
    buf = io.BytesIO()
    if SEED in sweep.search_space:
        bands = {label: [by_trial[t.trial] for t in ts] for label, ts in seed_groups(sweep, rows).items()}
        plot_bands(bands, buf, title=f"sweep {sweep_id}: mean ± std over training.seed", fmt="png")
    else:
        plot_curves({label: by_trial[t.trial] for label, t in legend(rows).items()}, buf, title=f"sweep {sweep_id}",
                    fmt="png")
    return buf.getvalue()


def legend(rows: list[TrialRow]) -> dict[str, TrialRow]:
    """Each trial under its settings (``teleport.lr=0.1, training.seed=0``), not its id: the id is added only where
    two trials share their settings (a repeated grid point, or ``num_samples`` drawing alike)."""
    counts: dict[str, int] = {}
    for t in rows:
        counts[_label(t.config)] = counts.get(_label(t.config), 0) + 1
    return {_label(t.config) + (f" ({t.trial})" if counts[_label(t.config)] > 1 else ""): t for t in rows}
