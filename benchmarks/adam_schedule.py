"""Teleport with Adam: which schedule pays in wall-clock seconds.

The convergence benchmark's Adam row (digits, MLP [1024, 1024], lr 2e-4, target train loss 0.05, the paper's
teleport: η_tele 0.2, CAP 5, n = 32, t = 8, b = 4) reaches the target in fewer epochs than the baseline but more
seconds. Side by side, per seed: the baseline, the paper's schedule (before epochs 0-4) and one teleport before
epoch 0 only, each without a budget (the schedule as it is), 12 epochs (the target falls at ~6); both schedules again
with the scale-free teleport (``SCALE_FREE``: one step to twice each batch's ‖∇L‖²). Reported: epochs and seconds to
the target, the seconds as a ratio to the baseline's, teleport's seconds.

    python -m benchmarks.adam_schedule [--quick] [--seeds N]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from api_schemas import build_spec
from benchmarks.common import print_table, verdict, write_result
from benchmarks.convergence import mlp_case

# name -> (the epochs teleport runs before, with the scale-free teleport?), or None: no teleport
SCHEDULES: dict[str, tuple[list[int], bool] | None] = {
    "baseline": None, "paper: epochs 0-4": ([0, 1, 2, 3, 4], False), "epoch 0 only": ([0], False),
    "scale-free: epochs 0-4": ([0, 1, 2, 3, 4], True), "scale-free: epoch 0 only": ([0], True)}


def one(seed: int, schedule: tuple[list[int], bool] | None, n_epochs: int, quick: bool) -> dict[str, Any]:
    from workers.train.context import RunContext
    from workers.train.loop import train

    epochs, scale_free = schedule or (None, False)
    case = mlp_case("adam", 1, n_epochs, [32] if quick else [1024, 1024], 4, 200 if quick else None,
                    scale_free=scale_free)
    data = case.spec(seed, epochs is not None)
    data["training"]["epochs"] = n_epochs
    if epochs is not None:
        data["teleport"].update(epochs=epochs, budget=None)
    return train(build_spec(data), RunContext())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds, n_epochs = (1, 3) if args.quick else (args.seeds, 12)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SCHEDULES}
    for seed in range(seeds):  # interleaved: a load spike hits every schedule alike
        for name, schedule in SCHEDULES.items():
            runs[name].append(one(seed, schedule, n_epochs, args.quick))

    def mean(name: str, key: str) -> float | None:
        got = [r[key] for r in runs[name] if r[key] is not None]
        return statistics.fmean(got) if got else None

    base = mean("baseline", "seconds_to_target")
    rows = {name: {"epochs_to_target": mean(name, "epochs_to_target"),
                   "seconds_to_target": mean(name, "seconds_to_target"),
                   "teleport_seconds": mean(name, "teleport_seconds"),
                   "reached": sum(r["seconds_to_target"] is not None for r in runs[name])} for name in SCHEDULES}
    for row in rows.values():
        s = row["seconds_to_target"]
        row["seconds_ratio"] = s / base if s is not None and base else None
    print_table(["schedule", "epochs to target", "seconds to target", "vs baseline", "teleport s"], [
        [n, f"{r['epochs_to_target'] or float('nan'):.2f}", f"{r['seconds_to_target'] or float('nan'):.2f}",
         f"{r['seconds_ratio'] or float('nan'):.2f}x", f"{r['teleport_seconds'] or 0:.2f}"] for n, r in rows.items()])
    ok = (rows["epoch 0 only"]["seconds_ratio"] or float("inf")) < 1.0
    print(f"Adam, teleport before epoch 0 only, reaches the target in < 1.0x the baseline's seconds: {verdict(ok)}")
    result = {"quick": args.quick, "seeds": seeds, "epochs": n_epochs, "rows": rows, "floors": {"adam_lt_1x": ok}}
    write_result("adam_schedule", result)
    return result


if __name__ == "__main__":
    main()
