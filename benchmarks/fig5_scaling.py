"""The paper's Figure 5: runtime of one teleport, symmetry vs null-space, in t, d, n, l and b.

One teleport = b batches of n samples, t ascent steps on each, on a LeakyReLU MLP with l Linear
layers (784 → d → … → d → 10, i.e. l − 1 hidden layers of width d), 784-d standard-normal inputs
like flattened MNIST, 10 classes, cross-entropy. One factor varies at a time around the base;
both methods run side by side on copies of the same model and batches, interleaved repeat by
repeat, and the table gives seconds and the ratio symmetry / null-space.

CAP and loss_tol are set out of reach so that every step runs (no early stop); each point checks
that every batch took exactly t steps with no back-off. The growth exponent is the least-squares
slope of log(time) against log(factor). Floors (printed, not asserted): null-space time grows no
faster than linearly in t, l and b (slope ≤ 1.1), and null-space is ≥ 4× faster than symmetry at
width 1024.

    python -m benchmarks.fig5_scaling [--quick] [--repeats R] [--threads K] [--factors d ...]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import (
    Canary,
    add_machine_args,
    leaky_mlp,
    loglog_slope,
    print_table,
    quiet_machine,
    time_interleaved,
    verdict,
    write_result,
)
from teleport import TeleportConfig, Teleporter, TeleportReport, symmetry_teleport_batch
from teleport.geometry.eigh_route import EighRoutes

INPUT_DIM = 784
CLASSES = 10
LR = 1e-3  # small, so that with CAP and loss_tol disabled no run blows up (the paper's 0.2 does on small MLPs)
NO_STOP = {"cap": 1e12, "loss_tol": 1e9}
FACTORS = ("t", "d", "n", "l", "b")
NAMES = {"t": "steps per batch", "d": "hidden width", "n": "batch size", "l": "Linear layers", "b": "batches"}

BASE = {"t": 8, "d": 256, "n": 32, "l": 3, "b": 4}
SWEEPS = {"t": [1, 2, 4, 8, 16], "d": [64, 128, 256, 512, 1024], "n": [16, 32, 64, 128],
          "l": [2, 3, 4, 6, 8], "b": [1, 2, 4, 8]}
QUICK_BASE = {"t": 2, "d": 32, "n": 8, "l": 2, "b": 1}
QUICK_SWEEPS = {"t": [1, 2], "d": [16, 32], "n": [8, 16], "l": [2, 3], "b": [1, 2]}

LINEAR_FACTORS = ("t", "l", "b")  # null-space time must grow no faster than linearly in these
MAX_SLOPE = 1.1
WIDTH_FLOOR = (1024, 4.0)  # at this width null-space must be at least this many times faster


Method = Callable[[nn.Module, list[tuple[Tensor, Tensor]], TeleportConfig, EighRoutes], list[TeleportReport]]


def symmetry(m: nn.Module, batches: list[tuple[Tensor, Tensor]], config: TeleportConfig,
             routes: EighRoutes) -> list[TeleportReport]:
    return [symmetry_teleport_batch(m, F.cross_entropy, x, y, config) for x, y in batches]


def nullspace(m: nn.Module, batches: list[tuple[Tensor, Tensor]], config: TeleportConfig,
              routes: EighRoutes) -> list[TeleportReport]:
    """The b batches by one teleporter of the model (what one batch teaches the next is kept), the eigh by ``routes``:
    the run's, measured once per shape."""
    teleporter = Teleporter(m, F.cross_entropy, config)
    teleporter.routes = routes
    return [teleporter.teleport(x, y) for x, y in batches]


METHODS: dict[str, Method] = {"symmetry": symmetry, "nullspace": nullspace}


def symmetry_exact(point: dict[str, int]) -> bool:
    """Symmetry teleport keeps the loss only when n ≤ every transformed layer's input width + 1."""
    widths = [INPUT_DIM] + [point["d"]] * (point["l"] - 2)  # inputs of layers 0 .. l-2 (those it rewrites)
    return point["n"] <= min(widths) + 1


MAX_SPREAD, RETRIES = 1.5, 2  # re-measure when repeats or the canary are >1.5x off


def measure(point: dict[str, int], warmup: int, repeats: int, canary: Canary | None = None,
            seed: int = 0, retries: int = RETRIES, routes: EighRoutes | None = None) -> dict[str, Any]:
    """Seconds of one teleport (b batches × t steps) by each method at one (t, d, n, l, b); ``routes``: the null-space
    teleports' eigh routes (the run's: new ones when None)."""
    routes = EighRoutes() if routes is None else routes
    t, d, n, layers, b = (point[k] for k in FACTORS)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = leaky_mlp([INPUT_DIM] + [d] * (layers - 1) + [CLASSES])
    batches = [(torch.randn(n, INPUT_DIM, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen))
               for _ in range(b)]
    config = TeleportConfig(steps=t, lr=LR, **NO_STOP)

    def teleport_all(method: Method) -> Callable[[nn.Module], list[TeleportReport]]:
        def go(m: nn.Module) -> list[TeleportReport]:
            return method(m, batches, config, routes)

        return go

    load_before = os.getloadavg()[0]
    timings = time_interleaved({name: (teleport_all(fn), lambda: copy.deepcopy(model)) for name, fn in METHODS.items()},
                               warmup=warmup, repeats=repeats, max_spread=MAX_SPREAD, retries=retries, canary=canary)
    row: dict[str, Any] = {**point, "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    for name, timing in timings.items():
        reports: list[TeleportReport] = timing["value"]
        steps = [r.steps for r in reports]
        if steps != [t] * b or any(r.backoffs for r in reports):
            raise RuntimeError(f"{name} at {point}: steps {steps}, back-offs {[r.backoffs for r in reports]}, "
                               f"stop reasons {[r.stop_reason for r in reports]}; expected {t} steps on each "
                               f"batch with no back-off (lower LR in benchmarks/fig5_scaling.py)")
        drift = max(abs(r.loss_after - r.loss_before) for r in reports)
        if not math.isfinite(drift):
            raise RuntimeError(f"{name} at {point}: the loss went non-finite; lower LR in benchmarks/fig5_scaling.py")
        row[name] = {"seconds": timing["median"], "min_seconds": timing["min"], "samples": timing["samples"],
                     "spread": timing["spread"], "attempts": timing["attempts"], "steps_per_batch": steps,
                     "max_abs_loss_drift": drift}
    row["ratio"] = row["symmetry"]["seconds"] / row["nullspace"]["seconds"]
    row["spread"] = max(row[m]["spread"] for m in METHODS)
    row["contention"] = max(t["contention"] for t in timings.values())
    row["attempts"] = max(t["attempts"] for t in timings.values())
    row["symmetry_loss_invariant"] = symmetry_exact(point)
    return row


def run(base: dict[str, int], sweeps: dict[str, list[int]], warmup: int, repeats: int,
        retries: int = RETRIES) -> dict[str, Any]:
    """Every sweep's points measured (the base once); ``retries``: re-measures of a noisy point, each after a 5 s,
    10 s, ... pause (``--quick`` takes none: its timings are a smoke test's, and under a loaded ``make test`` every
    point was noisy, 15 s of pauses each)."""
    sweep_rows: dict[str, list[dict[str, Any]]] = {}
    slopes: dict[str, dict[str, float]] = {}
    tables: list[str] = []
    measured: dict[tuple[int, ...], dict[str, Any]] = {}
    canary = Canary()
    routes = EighRoutes()  # the run's: a shape's eigh route measured once, by the first teleport that meets it
    for factor in sweeps:
        rows = []
        print(f"\n[{factor}: {NAMES[factor]}] base {base}", flush=True)
        for value in sweeps[factor]:
            point = {**base, factor: value}
            key = tuple(point[k] for k in FACTORS)
            if key not in measured:  # the base point is in every sweep: measure it once
                measured[key] = measure(point, warmup, repeats, canary, retries=retries, routes=routes)
            rows.append(measured[key])
            r = rows[-1]
            print(f"  {factor}={value:<5d} symmetry {r['symmetry']['seconds']:.4f}s  nullspace "
                  f"{r['nullspace']['seconds']:.4f}s  ratio {r['ratio']:.2f}x", flush=True)
        xs = [r[factor] for r in rows]
        slopes[factor] = {m: loglog_slope(xs, [r[m]["seconds"] for r in rows]) for m in METHODS}
        sweep_rows[factor] = rows
        title = f"{factor} ({NAMES[factor]}); others at base"
        table = [[r[factor], r["t"] * r["b"], f"{r['symmetry']['seconds']:.4f}", f"{r['nullspace']['seconds']:.4f}",
                  f"{r['ratio']:.2f}x", "yes" if r["symmetry_loss_invariant"] else "NO",
                  f"{r['spread']:.2f}", f"{r['contention']:.2f}"] for r in rows]
        table.append(["slope", "", f"{slopes[factor]['symmetry']:.2f}", f"{slopes[factor]['nullspace']:.2f}", "", "",
                      "", ""])
        tables.append(title)
        print(f"\n{title}")
        headers = [factor, "steps", "symmetry s", "nullspace s", "sym/null", "sym exact", "spread", "contention"]
        tables.append(print_table(headers, table))

    floors: list[dict[str, Any]] = []
    for factor in LINEAR_FACTORS:
        if factor in slopes and len(sweeps[factor]) > 1:
            s = slopes[factor]["nullspace"]
            floors.append({"floor": f"null-space time grows no faster than linearly in {factor}",
                           "value": s, "limit": MAX_SLOPE, "pass": s <= MAX_SLOPE})
    width, factor_needed = WIDTH_FLOOR
    at_width = [r for r in sweep_rows.get("d", []) if r["d"] == width]
    if at_width:
        ratio = at_width[0]["ratio"]
        floors.append({"floor": f"null-space ≥ {factor_needed:g}x faster than symmetry at width {width}",
                       "value": ratio, "limit": factor_needed, "pass": ratio >= factor_needed})
    print()
    for f in floors:
        print(f"{verdict(f['pass'])}  {f['floor']}: {f['value']:.2f} (limit {f['limit']:g})")
    notes = [
        f"torch.set_num_threads({torch.get_num_threads()}); seconds are medians of {repeats} interleaved repeats "
        f"after {warmup} warm-up, each one teleport = b batches x t steps on a fresh copy of the same model",
        "MLP: 784 -> d x (l-1) -> 10, LeakyReLU(0.1), 784-d N(0,1) inputs, 10 random classes, cross-entropy, "
        f"float32; lr {LR}, CAP and loss_tol disabled, every batch verified to take exactly t steps",
        "symmetry teleport is loss-invariant only when n <= each rewritten layer's input width + 1 "
        "('sym exact' column); it does not change the timing",
        "spread = upper-quartile / fastest repeat (worst method); contention = slowdown of a fixed matmul canary timed "
        "before and after the point over its quiet baseline (1.0 = the machine was ours); a point where either "
        f"exceeds {MAX_SPREAD} is re-measured up to {retries} times and the least noisy attempt kept; the JSON "
        "also has the 1-minute load average",
        "null-space time includes capturing R and one SVD per layer per batch; symmetry pays pinv + inverse "
        "and their double backward on every step",
    ]
    print("\nnotes:\n" + "\n".join(f"- {n}" for n in notes), flush=True)
    return {"base": base, "sweeps": sweeps, "repeats": repeats, "warmup": warmup, "lr": LR, "rows": sweep_rows,
            "slopes": slopes, "floors": floors, "notes": notes, "tables": "\n".join(tables)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for the smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per point (default 5, quick 1)")
    parser.add_argument("--factors", nargs="+", choices=FACTORS, default=list(FACTORS),
                        help="sweep only these factors (results then go to fig5_scaling_<factors>.json)")
    add_machine_args(parser)
    args = parser.parse_args(argv)
    with quiet_machine("fig5_scaling", args):
        base, sweeps = (QUICK_BASE, QUICK_SWEEPS) if args.quick else (BASE, SWEEPS)
        result = run(base, {f: sweeps[f] for f in FACTORS if f in args.factors}, warmup=0 if args.quick else 1,
                     repeats=args.repeats or (1 if args.quick else 5), retries=0 if args.quick else RETRIES)
        name = "fig5_scaling" if set(args.factors) == set(FACTORS) else "fig5_scaling_" + "".join(args.factors)
        write_result(name, {"quick": args.quick, **result})  # machine info: the threads it ran with
    return result


if __name__ == "__main__":
    main()
