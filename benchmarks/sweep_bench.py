"""Sweeps through the service: Ray Tune's overhead, and a 12-trial search against the paper's default.

Both parts run on one embedded stack (real Redis, a local Ray head, the API and the scheduler)
and submit over REST, as a user would.

1. Overhead: k identical trials (the same spec k times) as one sweep with one trial at a time,
   against the same spec run k times in-process (``tlab run --local``, one process each, one after
   another), submitted as k experiments one after another (each waited for), and the sweep again
   with two trials at once. Wall time from the first submit to the last end; the ratio sweep /
   in-process is what a sweep costs beyond the training itself (the floor: ≤ 1.5 for k = 4,
   10 epochs, one at a time), sweep / sequential is Tune's overhead over the experiments' route.
2. Search: the paper's MNIST row on digits (MLP [1024, 1024], SGD η_prim = 2e-4, teleport before
   epochs 0-4 with n = 32, t = 8, b = 4; see benchmarks/convergence.py) — a 12-trial random search
   with ASHA over η_tele (log-uniform 0.02-2), CAP (1, 2, 5, 10, 20) and τ (1, 0.999, 0.99) on the
   final train loss after a short horizon; then the best configuration, the paper's default
   (η_tele = 0.2, CAP = 5, τ = 1) and no teleport, each over 3 seeds as a seed sweep: epochs and
   seconds to the target train loss (2.0, as in benchmarks/convergence.py), mean ± std.

    python -m benchmarks.sweep_bench [--quick] [--parts overhead search]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, results_dir, wait_for_quiet, write_result
from service.cli.client import Client
from service.stack.embedded import Stack

PARTS = ("overhead", "search")
TERMINAL = {"succeeded", "failed", "cancelled"}
TINY = {"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [32]},
        "training": {"epochs": 10, "batch_size": 64}, "teleport": {"enabled": False},
        "resources": {"cpus_per_worker": 0.9}}  # as recorded (a 1-worker trial now holds these 0.9 itself)
PAPER_DEFAULT = {"teleport.lr": 0.2, "teleport.cap": 5.0, "teleport.tau": 1.0}
TARGET = 2.0
SEARCH_SPACE = {"teleport.lr": {"loguniform": [0.02, 2.0]}, "teleport.cap": {"choice": [1, 2, 5, 10, 20]},
                "teleport.tau": {"choice": [1.0, 0.999, 0.99]}}


def paper_mnist_spec(epochs: int, hidden: list[int]) -> dict[str, Any]:
    return {"model": {"kind": "mlp", "hidden": hidden}, "dataset": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 2e-4},
            "training": {"epochs": epochs, "batch_size": 32, "target_loss": TARGET},
            "teleport": {"enabled": True, "method": "nullspace", "epochs": [0, 1, 2, 3, 4], "batches": 4,
                         "steps": 8, "batch_size": 32, "lr": 0.2, "cap": 5.0, "tau": 1.0},
            "resources": {"cpus_per_worker": 0.9}}


def wait_end(c: Client, path: str, poll_s: float = 0.2, timeout_s: float = 3600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = c.json("GET", path)
        job = view.get("job", view)
        if job["state"] in TERMINAL:
            if job["state"] != "succeeded":
                raise RuntimeError(f"{path}: {job['state']}: {job.get('failure_reason')}")
            return view
        time.sleep(poll_s)
    raise TimeoutError(f"{path} did not end within {timeout_s} s")


def run_sweep(c: Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    sweep = c.json("POST", "/v1/sweeps", json=body)["id"]
    view = wait_end(c, f"/v1/sweeps/{sweep}")
    return time.perf_counter() - t0, view


def in_process(spec: dict[str, Any], k: int) -> dict[str, Any]:
    """``tlab run SPEC --local`` k times, one after another, each its own process (as a person runs it)."""
    per_run = []
    with tempfile.TemporaryDirectory(prefix="tlab-sweep-bench-local-") as tmp:
        path = Path(tmp, "spec.json")
        path.write_text(json.dumps(spec))
        env = {**os.environ, "RAY_ADDRESS": ""}
        for i in range(k):
            s = time.perf_counter()
            subprocess.run([sys.executable, "-m", "workers.cli", "run", str(path), "--local", "--no-progress",
                            "--out", str(Path(tmp, f"run-{i}"))], check=True, env=env, stdout=subprocess.DEVNULL)
            per_run.append(time.perf_counter() - s)
    return {"seconds": sum(per_run), "per_run_s": per_run}


def overhead(c: Client, k: int, epochs: int) -> dict[str, Any]:
    spec = {**TINY, "training": {**TINY["training"], "epochs": epochs}}
    rows: dict[str, Any] = {"in-process": in_process(spec, k)}
    t0 = time.perf_counter()
    per_job = []
    for i in range(k):
        s = time.perf_counter()
        job = c.json("POST", "/v1/experiments", json={"spec": spec, "name": f"bench-seq-{i}"})
        wait_end(c, f"/v1/experiments/{job['id']}")
        per_job.append(time.perf_counter() - s)
    rows["sequential"] = {"seconds": time.perf_counter() - t0, "per_job_s": per_job}
    for concurrent in (1, 2):
        body = {"base": spec, "search_space": {"training.seed": {"grid": [0]}}, "num_samples": k,
                "max_concurrent_trials": concurrent, "name": f"bench-sweep-{concurrent}"}
        seconds, view = run_sweep(c, body)
        assert len(view["trials"]) == k and all(t["epochs"] == epochs for t in view["trials"]), view["trials"]
        rows[f"sweep, {concurrent} at once"] = {"seconds": seconds, "trials": len(view["trials"])}
    base, local = rows["sequential"]["seconds"], rows["in-process"]["seconds"]
    for row in rows.values():
        row["ratio_to_sequential"] = row["seconds"] / base
        row["ratio_to_in_process"] = row["seconds"] / local
    print_table(["route", "k", "seconds", "per run", "ratio to in-process", "ratio to sequential"],
                [[name, k, f"{r['seconds']:.1f}", f"{r['seconds'] / k:.1f}", f"{r['ratio_to_in_process']:.2f}",
                  f"{r['ratio_to_sequential']:.2f}"] for name, r in rows.items()])
    return {"k": k, "epochs": epochs, "spec": spec, "rows": rows}


def seed_study(c: Client, base: dict[str, Any], seeds: int, name: str) -> dict[str, Any]:
    body = {"base": base, "search_space": {"training.seed": {"grid": list(range(seeds))}},
            "max_concurrent_trials": 2, "name": name}
    seconds, view = run_sweep(c, body)
    study = c.json("GET", f"/v1/sweeps/{view['job']['id']}/study")
    (group,) = study["groups"]
    return {"sweep": view["job"]["id"], "seconds": seconds, "stats": group["stats"], "runs": group["runs"]}


def with_config(spec: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    out = {**spec, "teleport": dict(spec["teleport"])}
    for path, value in config.items():
        section, key = path.split(".")
        out[section] = {**out[section], key: value}
    return out


def search(c: Client, trials: int, horizon: int, epochs: int, seeds: int, hidden: list[int]) -> dict[str, Any]:
    base = paper_mnist_spec(horizon, hidden)
    body = {"base": base, "num_samples": trials, "scheduler": "asha", "grace_period": max(1, horizon // 4),
            "max_concurrent_trials": 2, "metric": "train_loss", "mode": "min", "name": "bench-search",
            "search_space": SEARCH_SPACE}
    seconds, view = run_sweep(c, body)
    best = view["best"]
    print(f"search: {len(view['trials'])} trials in {seconds:.0f} s, "
          f"{sum(t['stopped_early'] for t in view['trials'])} stopped early; best {best['config']} "
          f"(train loss {best['best']:.4g} after {best['epochs']} epochs)", flush=True)
    long = paper_mnist_spec(epochs, hidden)
    variants = {"best found": with_config(long, best["config"]), "paper default": with_config(long, PAPER_DEFAULT),
                "no teleport": with_config(long, {"teleport.enabled": False})}
    studies = {label: seed_study(c, spec, seeds, f"bench-{label}") for label, spec in variants.items()}

    def pm(s: dict[str, Any], digits: int = 3) -> str:
        return "-" if s["mean"] is None else f"{s['mean']:.{digits}g} ± {s['std']:.2g} ({s['n']}/{seeds})"

    print_table(["variant", "config", f"epochs to {TARGET:g}", f"seconds to {TARGET:g}", "final train loss"],
                [[label, " ".join(f"{k.split('.')[1]}={v:.3g}" if isinstance(v, float) else f"{k.split('.')[1]}={v}"
                                  for k, v in (best["config"] if label == "best found" else
                                               PAPER_DEFAULT if label == "paper default" else {}).items()) or "-",
                  pm(s["stats"]["epochs_to_target"]), pm(s["stats"]["seconds_to_target"]),
                  pm(s["stats"]["final_train_loss"], 4)] for label, s in studies.items()])
    return {"trials": len(view["trials"]), "horizon_epochs": horizon, "epochs": epochs, "seeds": seeds,
            "hidden": hidden, "target_loss": TARGET, "search_seconds": seconds, "search_space": body["search_space"],
            "best": best, "trials_table": view["trials"], "studies": studies}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="k = 2, a 3-trial search on a small MLP, 2 seeds")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    args = parser.parse_args(argv)
    if not args.quick:
        wait_for_quiet()
    result: dict[str, Any] = {"parts": args.parts, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="tlab-sweep-bench-") as home:
        with Stack(Path(home), num_cpus=2, tick_s=0.2) as stack, Client(stack.url, stack.admin_token) as c:
            if "overhead" in args.parts:
                result["overhead"] = overhead(c, k=2 if args.quick else 4, epochs=3 if args.quick else 10)
            if "search" in args.parts:
                result["search"] = (search(c, trials=3, horizon=2, epochs=3, seeds=2, hidden=[64]) if args.quick else
                                    search(c, trials=12, horizon=20, epochs=50, seeds=3, hidden=[1024, 1024]))
    previous = results_dir(args.quick) / "sweeps.json"
    if previous.exists():  # a run of some parts keeps the others' last results
        kept = {part: body for part, body in json.loads(previous.read_text()).items()
                if part in PARTS and part not in args.parts}
        result = {**kept, **result, "parts": sorted(set(args.parts) | set(kept), key=PARTS.index)}
    write_result("sweeps", result)
    return result


if __name__ == "__main__":
    main()
