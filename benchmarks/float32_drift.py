"""Float32 batch-loss drift and back-offs of teleport on the digits presets, for both readings of τ = 1.

For the digits MLP preset (``digits/teleport``: MLP [256, 256], SGD) and the digits CNN preset
(``digits/cnn``: CNN [16, 32], 40 warm-up steps), each with ``teleport.tau_rule`` = numerical_rank and
energy, 3 seeds: the preset's own run in float32 (its teleport schedule: b = 32 batches of n = 32 before
each of epochs 0-4, t = 8 steps, its η, CAP and loss_tol), trained for the 5 epochs its teleports need,
on ``training.device`` (auto: CUDA when one is visible). From the teleport reports of every batch:

    drift          = |L_after − L_before| / |L_before| on the teleport batch, of accepted teleports (steps > 0)
    back-off rate  = Σ backoffs / Σ (steps + backoffs)      (every try is an accepted step or a back-off)
    free directions per layer (min … max over the batches that built bases)

Floor (printed, never asserted): drift below 1e-4 on the MLP and CNN presets.

    python -m benchmarks.float32_drift [--quick] [--seeds N] [--threads K]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

from api_schemas import ExperimentSpec, build_spec
from api_schemas.presets import preset
from benchmarks.common import print_table, verdict, write_result

PRESETS = {"mlp": "digits/teleport", "cnn": "digits/cnn"}
RULES = ("numerical_rank", "energy")
SEEDS = 3
FLOOR = 1e-4  # float32 batch-loss drift on the MLP and CNN presets


def case_spec(name: str, rule: str, seed: int, quick: bool) -> ExperimentSpec:
    """The preset in float32 with ``tau_rule`` and ``seed``, trained just past its last teleport epoch."""
    data = preset(name)
    tp, tr = data["teleport"], data["training"]
    tp.update(tau_rule=rule, budget=None)  # every teleport of the preset's schedule: the drift of each is measured
    tr.update(seed=seed, dtype="float32", epochs=max(tp["epochs"]) + 1)
    if quick:  # one teleport epoch of 2 batches on 128 samples: seconds
        tp.update(epochs=[0], batches=2)
        tr.update(epochs=1, warmup_steps=min(tr.get("warmup_steps", 0), 2))
        data["dataset"]["max_train"] = 128
    return build_spec(data)


def teleports(spec: ExperimentSpec, threads: int) -> tuple[list[dict[str, Any]], str, float]:
    """The run's teleport records, the device it ran on and its seconds."""
    from workers.train.build import select_device
    from workers.train.context import RunContext
    from workers.train.loop import train
    from workers.train.sinks import MemorySink

    sink, device = MemorySink(), select_device(spec.training)
    start = time.perf_counter()
    train(spec, RunContext(device=device, sink=sink), threads=threads)
    return [r for r in sink.records if r["kind"] == "teleport"], str(device), time.perf_counter() - start


def drift(record: dict[str, Any]) -> float:
    return abs(record["loss_after"] - record["loss_before"]) / max(abs(record["loss_before"]), 1e-12)


def free_per_layer(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per layer: input dim, and the kept rank and free directions, min and max over the batches."""
    out: dict[str, dict[str, int]] = {}
    for layer in (layer for r in records for layer in r["layers"]):
        row = out.setdefault(layer["name"], {"input_dim": layer["input_dim"], "free_min": layer["free"],
                                             "free_max": layer["free"], "rank_min": layer["rank"],
                                             "rank_max": layer["rank"]})
        for key in ("free", "rank"):
            row[f"{key}_min"] = min(row[f"{key}_min"], layer[key])
            row[f"{key}_max"] = max(row[f"{key}_max"], layer[key])
    return out


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Drift of accepted teleports, the back-off rate, stop reasons and free directions of some teleports."""
    drifts = [drift(r) for r in records if r["steps"] > 0]
    steps, backoffs = sum(r["steps"] for r in records), sum(r["backoffs"] for r in records)
    return {
        "teleports": len(records),
        "accepted": len(drifts),
        "drift_max": max(drifts, default=None),
        "drift_median": statistics.median(drifts) if drifts else None,
        "steps": steps,
        "backoffs": backoffs,
        "tries": steps + backoffs,
        "backoff_rate": backoffs / (steps + backoffs) if steps + backoffs else 0.0,
        "stop_reasons": dict(Counter(r["stop_reason"] for r in records)),
        "free_per_layer": free_per_layer(records),
    }


def measure(name: str, rule: str, seeds: int, quick: bool, threads: int) -> dict[str, Any]:
    """One preset under one τ rule: every seed's records pooled, plus each seed's own summary."""
    pooled: list[dict[str, Any]] = []
    per_seed, device = [], ""
    for seed in range(seeds):
        records, device, seconds = teleports(case_spec(name, rule, seed, quick), threads)
        pooled += records
        per_seed.append({"seed": seed, "seconds": seconds,
                         **{k: v for k, v in summary(records).items() if k != "free_per_layer"}})
        print(f"    {name} {rule} seed {seed}: {per_seed[-1]['accepted']} accepted of {len(records)}, "
              f"max drift {_sci(per_seed[-1]['drift_max'])}, {seconds:.1f} s", flush=True)
    return {"preset": name, "tau_rule": rule, "device": device, **summary(pooled), "per_seed": per_seed}


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def _free(row: dict[str, Any]) -> str:
    def one(layer: dict[str, int]) -> str:
        lo, hi = layer["free_min"], layer["free_max"]
        return f"{lo}/{layer['input_dim']}" if lo == hi else f"{lo}-{hi}/{layer['input_dim']}"

    return ", ".join(f"{n} {one(layer)}" for n, layer in row["free_per_layer"].items())


def run(quick: bool, seeds: int, threads: int) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for model, name in PRESETS.items():
        for rule in RULES:
            rows[f"{model}/{rule}"] = measure(name, rule, seeds, quick, threads)
    print(f"\nfloat32 teleport on the digits presets, {seeds} seed(s); drift relative, of accepted teleports")
    text = print_table(
        ["preset", "tau_rule", "accepted/teleports", "drift max", "drift median", "back-offs/tries", "rate",
         "free directions (layer free/input dim)"],
        [[r["preset"], r["tau_rule"], f"{r['accepted']}/{r['teleports']}", _sci(r["drift_max"]),
          _sci(r["drift_median"]), f"{r['backoffs']}/{r['tries']}", f"{r['backoff_rate']:.1%}", _free(r)]
         for r in rows.values()])
    floors = [{"floor": f"{r['preset']} ({r['tau_rule']}): float32 drift < {FLOOR:g}", "value": r["drift_max"],
               "limit": FLOOR, "pass": r["drift_max"] is not None and r["drift_max"] < FLOOR}
              for r in rows.values()]
    print()
    for f in floors:
        print(f"{verdict(f['pass'])}  {f['floor']}: {_sci(f['value'])}", flush=True)
    notes = [
        "each run: the preset in float32 (training.dtype), teleport.tau_rule as given, training.seed = seed, "
        "trained for max(teleport.epochs) + 1 epochs so every scheduled teleport runs with training between",
        "drift = |loss_after - loss_before| / |loss_before| from the teleport report (the batch loss in float32), "
        "over teleports that took at least one step; a batch at CAP takes 0 steps and is not counted",
        "back-off rate = backoffs / (steps + backoffs) summed over every teleport of the seeds",
        "free directions: per layer (rows sharing their uses), min-max over the batches that built bases",
    ]
    return {"seeds": seeds, "threads": threads, "floor": FLOOR, "rows": rows, "floors": floors, "notes": notes,
            "table": text}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 seed, 1 epoch, 2 teleport batches (seconds)")
    parser.add_argument("--seeds", type=int, default=None, help=f"seeds 0..N-1 (default {SEEDS}, quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while training (default 1)")
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else SEEDS)
    print(f"float32_drift: {seeds} seed(s), {args.threads} thread(s){' (quick)' if args.quick else ''}", flush=True)
    result = run(args.quick, seeds, args.threads)
    write_result("float32_drift", {"quick": args.quick, **result})
    return result


if __name__ == "__main__":
    main()
