"""Run every benchmark in this folder in sequence; each writes ``benchmarks/results/<name>.json``.

Known benchmarks run first in a fixed order; any other module here with a ``main(argv)`` runs
after them. A listed benchmark whose module is missing is skipped with a message, and one that
fails is reported and the rest still run (the exit status is 1 then).

    python -m benchmarks.run_all [--quick] [--only NAME ...] [--skip NAME ...]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pkgutil
import time
import traceback
from pathlib import Path

from benchmarks.common import QUICK_DIR

ORDER = ["fig5_scaling", "step_cost", "float32_drift", "convergence", "parallel_bases", "service_bench", "sweep_bench"]
NOT_BENCHMARKS = {"common", "run_all", "service"}  # service: service_bench's parts, not a benchmark


def discover() -> list[str]:
    """Benchmark module names: the known order, then any other module in this folder."""
    here = Path(__file__).resolve().parent
    present = {m.name for m in pkgutil.iter_modules([str(here)])} - NOT_BENCHMARKS
    return ORDER + sorted(present - set(ORDER))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes for every benchmark (a smoke run)")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these benchmarks")
    parser.add_argument("--skip", nargs="+", default=[], metavar="NAME", help="leave these benchmarks out")
    args = parser.parse_args(argv)
    names = [n for n in (args.only or discover()) if n not in args.skip]
    if args.quick and not os.environ.get("BENCH_RESULTS_DIR"):  # keep smoke results out of benchmarks/results
        os.environ["BENCH_RESULTS_DIR"] = str(QUICK_DIR)
        print(f"--quick: results go to {QUICK_DIR}", flush=True)
    status: dict[str, str] = {}
    for i, name in enumerate(names, 1):
        print(f"\n===== [{i}/{len(names)}] benchmarks.{name}{' --quick' if args.quick else ''} =====", flush=True)
        if importlib.util.find_spec(f"benchmarks.{name}") is None:
            print(f"skipped: benchmarks/{name}.py does not exist (yet)", flush=True)
            status[name] = "missing"
            continue
        module = importlib.import_module(f"benchmarks.{name}")  # lazily: only what runs is imported
        if not hasattr(module, "main"):
            print(f"skipped: benchmarks/{name}.py has no main(argv)", flush=True)
            status[name] = "no main"
            continue
        start = time.perf_counter()
        try:
            module.main(["--quick"] if args.quick else [])
        except Exception:  # report and go on with the rest
            traceback.print_exc()
            print(f"FAILED: benchmarks.{name}; rerun it alone with `python -m benchmarks.{name}` to debug",
                  flush=True)
            status[name] = "failed"
            continue
        status[name] = f"ok ({time.perf_counter() - start:.1f} s)"
    print("\n===== summary =====")
    for name, s in status.items():
        print(f"  {name:20s} {s}")
    return 1 if "failed" in status.values() else 0


if __name__ == "__main__":
    raise SystemExit(main())
