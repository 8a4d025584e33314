"""Layer-parallel bases: serial vs threads vs Ray tasks vs auto, for l layers of width d.

Each layer's representation is R (d, N) with N = 256 columns (a 256-sample teleport batch), so
every layer takes the thin-SVD route. All routes run side by side in one process and one Ray
cluster, taking turns within each repeat (medians of 5); the table reports seconds and each
route's ratio to the best one. ``auto`` runs the threads route on one node, so their ratio is
the measurement noise. The floor:
``auto`` is never more than 1.1x the best route.

    python -m benchmarks.parallel_bases [--quick]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from benchmarks.common import time_interleaved
from teleport import SerialExecutor, ThreadExecutor, compute_basis

COLUMNS = 256


def run(widths: list[int], layer_counts: list[int], repeats: int) -> dict[str, object]:
    import ray

    from workers.train.executors import RayTaskExecutor, make_executor

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="tlbench", dir="/tmp"), configure_logging=False)
    try:
        routes = {
            "serial": SerialExecutor(),
            "threads": ThreadExecutor(max_workers=os.cpu_count()),
            "ray": RayTaskExecutor(min_work=0.0),
            "auto": make_executor("auto"),
        }
        rows = []
        for d in widths:
            for layers in layer_counts:
                g = torch.Generator().manual_seed(d + layers)
                reps = [torch.randn(d, COLUMNS, generator=g) for _ in range(layers)]
                cases = {name: (lambda _, ex=ex, reps=reps: ex.map(lambda r: compute_basis(r, 1.0), reps), None)
                         for name, ex in routes.items()}
                # routes take turns within each repeat, so background load hits them alike
                timed = time_interleaved(cases, warmup=1, repeats=repeats, max_spread=1.5, retries=2)
                seconds = {name: t["median"] for name, t in timed.items()}
                best = min(seconds.values())
                rows.append({"width": d, "layers": layers, "seconds": seconds,
                             "ratio_to_best": {k: v / best for k, v in seconds.items()},
                             "best": min(seconds, key=seconds.__getitem__)})
                cells = "  ".join(f"{k}={v * 1e3:8.1f}ms ({v / best:4.2f}x)" for k, v in seconds.items())
                print(f"d={d:5d} l={layers:3d}  {cells}", flush=True)
    finally:
        ray.shutdown()
    worst_auto = max(r["ratio_to_best"]["auto"] for r in rows)  # type: ignore[index]
    print(f"floor: auto within 1.1x of the best route everywhere: {'PASS' if worst_auto <= 1.1 else 'FAIL'} "
          f"(worst {worst_auto:.2f}x)")
    return {"columns": COLUMNS, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "rows": rows,
            "auto_worst_ratio": worst_auto}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    args = parser.parse_args(argv)
    from benchmarks.common import wait_for_quiet, write_result

    if args.quick:
        result = {**run([64, 128], [2, 4], repeats=1), "quick": True}
    else:
        wait_for_quiet()
        result = run([256, 1024, 4096], [2, 4, 8, 16], repeats=5)
    write_result("parallel_bases", result)
    return result


if __name__ == "__main__":
    main()
