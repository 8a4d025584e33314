"""Helpers shared by the benchmarks: thread setup, timing, results JSON, plain-text tables.

Results go to ``benchmarks/results/<name>.json`` (committed), or to ``$BENCH_RESULTS_DIR`` when it is
set (the smoke tests point it at a temp dir); ``--quick`` runs go to a temp dir unless it is set.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def leaky_mlp(dims: list[int]) -> torch.nn.Module:
    """The project's MLP, LeakyReLU(0.1), dims = [in, *hidden, out]: what both teleport methods accept."""
    from workers.train.models import MLP

    return MLP(dims[0], dims[1:-1], dims[-1], activation="leaky_relu", negative_slope=0.1)


def set_threads(threads: int) -> int:
    """Pin torch's intra-op thread count (the benchmarks say which they used) and return it."""
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def add_machine_args(parser: argparse.ArgumentParser) -> None:
    """``--threads`` and ``--wait``: the options of every in-process timing benchmark."""
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--wait", type=float, default=None,
                        help="seconds to wait for a quiet machine first (default 120, quick 0)")


@contextlib.contextmanager
def quiet_machine(name: str, args: argparse.Namespace) -> Iterator[int]:
    """Wait for a quiet machine (``--wait``; none with ``--quick``), pin ``--threads`` and say so; restore after."""
    wait_for_quiet(timeout=args.wait if args.wait is not None else (0 if args.quick else 120))
    previous = torch.get_num_threads()
    threads = set_threads(args.threads)
    print(f"{name}: torch {torch.__version__}, torch.set_num_threads({threads})", flush=True)
    try:
        yield threads
    finally:
        torch.set_num_threads(previous)


def machine_info() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "loadavg_1_5_15m": [round(v, 2) for v in os.getloadavg()],  # others' work on a shared machine skews times
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def time_call(fn: Callable[[Any], object], setup: Callable[[], Any] | None = None, warmup: int = 1,
              repeats: int = 3) -> dict[str, Any]:
    """Median wall time (time.perf_counter) of ``fn(setup())`` over ``repeats`` runs after ``warmup`` runs.

    ``setup`` runs outside the timed region before every call (e.g. a fresh copy of a model that
    ``fn`` changes in place). Returns the median, the min and every timed sample in seconds, and
    the last call's return value under ``"value"``.
    """
    samples: list[float] = []
    value: object = None
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        sync()
        start = time.perf_counter()
        value = fn(arg)
        sync()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            samples.append(elapsed)
    return {"median": statistics.median(samples), "min": min(samples), "samples": samples, "value": value}


Timed = tuple[Callable[[Any], object], Callable[[], Any] | None]


def sync() -> None:
    """Wait for queued GPU work, so that a wall-clock timer around a call times the call (no-op on a CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def spread(samples: Sequence[float]) -> float:
    """Upper quartile over fastest sample: how unsteady a set of timings is (one outlier of 5+ is ignored)."""
    ordered = sorted(samples)
    return ordered[int(0.75 * (len(ordered) - 1) + 0.5)] / max(ordered[0], 1e-12)


class Canary:
    """A fixed matmul workload on torch's threads, timed around each measurement.

    Its slowdown over its own quiet baseline (taken at construction) says how much of the machine
    other processes took meanwhile: 1.0 when alone, 2-10 when someone else's tests hold the cores
    (with 2 threads on 2 busy cores, torch's thread pool waits on preempted threads).
    """

    def __init__(self, size: int = 256, reps: int = 10) -> None:
        self.a = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
        self.reps = reps
        self.baseline = min(self._once() for _ in range(15))

    def _once(self) -> float:
        start = time.perf_counter()
        for _ in range(self.reps):
            torch.mm(self.a, self.a)
        return time.perf_counter() - start

    def slowdown(self) -> float:
        times = [self._once() for _ in range(3)]
        self.baseline = min(self.baseline, *times)  # the quietest moment seen so far is the baseline
        return statistics.median(times) / self.baseline


def time_interleaved(cases: dict[str, Timed], warmup: int = 1, repeats: int = 3, max_spread: float | None = None,
                     retries: int = 0, canary: Canary | None = None) -> dict[str, dict[str, Any]]:
    """Like ``time_call`` for several ``(fn, setup)`` cases, run in turn within each repeat.

    Interleaving puts every case under the same background load (a shared machine drifts over
    seconds), so their ratios are fairer than timing one case's repeats after the other's.

    With ``max_spread``, an attempt is noisy when any case's ``spread`` (upper quartile / fastest)
    exceeds it, or when the ``canary`` (timed before and after) ran more than ``max_spread`` times slower
    than its quiet baseline. A noisy attempt is taken again, up to ``retries`` times after a pause;
    the least noisy attempt is kept. Each case's result has ``spread``, ``contention`` (the canary's
    worst slowdown, 1.0 without a canary) and ``attempts``.
    """
    best: dict[str, dict[str, Any]] | None = None
    best_noise = math.inf
    attempt = 0
    for attempt in range(1, retries + 2):
        contention = canary.slowdown() if canary is not None else 1.0
        samples: dict[str, list[float]] = {name: [] for name in cases}
        values: dict[str, object] = {}
        for i in range(warmup + repeats):
            for name, (fn, setup) in cases.items():
                arg = setup() if setup is not None else None
                sync()
                start = time.perf_counter()
                values[name] = fn(arg)
                sync()
                elapsed = time.perf_counter() - start
                if i >= warmup:
                    samples[name].append(elapsed)
        if canary is not None:
            contention = max(contention, canary.slowdown())
        result = {name: {"median": statistics.median(s), "min": min(s), "spread": spread(s),
                         "contention": contention, "samples": s, "value": values[name]}
                  for name, s in samples.items()}
        noise = max([contention] + [r["spread"] for r in result.values()])
        if noise < best_noise:
            best, best_noise = result, noise
        if max_spread is None or noise <= max_spread:
            break
        if attempt <= retries:
            print(f"    noisy measurement (spread/contention {noise:.2f} > {max_spread}); "
                  f"retrying in {5 * attempt} s", flush=True)
            time.sleep(5 * attempt)
    assert best is not None
    for r in best.values():
        r["attempts"] = attempt
    return best


def wait_for_quiet(max_load: float = 1.0, timeout: float = 120.0) -> float:
    """Wait (up to ``timeout`` s) for the 1-minute load average to drop below ``max_load``; returns it.

    On a shared machine someone else's tests can take both cores; timings taken then are worth little.
    """
    deadline = time.monotonic() + timeout
    load = os.getloadavg()[0]
    if load >= max_load:
        print(f"waiting up to {timeout:.0f} s for the machine to quiet down (1-min load {load:.2f} >= {max_load})",
              flush=True)
    while load >= max_load and time.monotonic() < deadline:
        time.sleep(5)
        load = os.getloadavg()[0]
    if load >= max_load:
        print(f"warning: load still {load:.2f}; timings will be inflated by other work", flush=True)
    return load


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x: the growth exponent (1.0 = linear)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / den


QUICK_DIR = Path(tempfile.gettempdir()) / "teleport-bench-quick"


def results_dir(quick: bool = False) -> Path:
    """``$BENCH_RESULTS_DIR`` if set; else benchmarks/results, or a temp dir for --quick smoke runs.

    Quick results never land in benchmarks/results, where the committed full results live.
    """
    env = os.environ.get("BENCH_RESULTS_DIR")
    if env:
        return Path(env)
    return QUICK_DIR if quick else RESULTS_DIR


def write_result(name: str, payload: dict[str, Any], directory: Path | str | None = None) -> Path:
    """Write ``payload`` plus machine info to ``<results dir>/<name>.json``; returns the path.

    A payload with ``"quick": True`` goes to the quick dir unless ``$BENCH_RESULTS_DIR`` says otherwise.
    """
    out = Path(directory) if directory is not None else results_dir(bool(payload.get("quick")))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    body = {"benchmark": name, "machine": machine_info(), **payload}
    path.write_text(json.dumps(body, indent=2, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table, right-aligned columns; floats are shown as given (format them first)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    text = format_table(headers, rows)
    print(text, flush=True)
    return text


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
