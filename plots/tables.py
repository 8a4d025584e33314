"""Tables of grouped runs: mean ± std over seeds of each run summary (``workers.train.loop.summarize``).

Used by ``tlab compare`` (in-process and through the service) and by the sweeps API's study view.
Pure Python: no torch, no Ray, no service.
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def stats(values: list[float]) -> dict[str, float | int | None]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"mean": None, "std": None, "n": 0}
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "n": len(values)}


def pm(s: dict[str, Any], digits: int = 4) -> str:
    return "-" if s["mean"] is None else f"{s['mean']:.{digits}g} ± {s['std']:.3g}"


COMPARE_METRICS = ("final_train_loss", "final_test_loss", "final_test_acc", "best_test_loss",
                   "epochs_to_target", "seconds_to_target", "teleport_share", "seconds")


def group_stats(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {m: stats([s.get(m) for s in runs]) for m in COMPARE_METRICS}


def compare_table(groups: dict[str, list[dict[str, Any]]], seeds: int, target: float | None) -> str:
    """One row per group, mean ± std over seeds; to-target columns count only the seeds that got there."""
    by_label = {label: group_stats(runs) for label, runs in groups.items()}
    header = ["run", "train loss", "test loss", "test acc"]
    if target is not None:
        header += [f"epochs to {target:g}", f"seconds to {target:g}"]
    header += ["teleport share", "seconds"]
    diverged = any(s.get("diverged") for runs in groups.values() for s in runs)
    if diverged:
        header.append("diverged")
    rows = [header]
    for label, st in by_label.items():
        row = [label, pm(st["final_train_loss"]), pm(st["final_test_loss"]), pm(st["final_test_acc"], 3)]
        if target is not None:
            reached = f" ({st['epochs_to_target']['n']}/{seeds})"
            row += [pm(st["epochs_to_target"], 3) + reached, pm(st["seconds_to_target"], 3) + reached]
        row += [pm(st["teleport_share"], 2), pm(st["seconds"], 3)]
        if diverged:
            row.append(f"{sum(bool(s.get('diverged')) for s in groups[label])}/{seeds}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:], *skipped_lines(groups)])


def skipped_lines(groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Under the table, each group whose teleports stopped early because one made no move: in how many seeds, and
    the first seed's reason (``teleport made no move at epoch 0 (...): the next teleports skipped``)."""
    out = []
    for label, runs in groups.items():
        said = [s["teleport_skipped"] for s in runs if s.get("teleport_skipped")]
        if said:
            out.append(f"{label}: {said[0]} ({len(said)}/{len(runs)} seeds)")
    return out
