"""Ray Train overhead: the same spec per epoch under Ray Train (1 worker) vs the in-process runner.

Both runs train the same digits MLP for the same epochs in one invocation; per-epoch time is the
median of the epoch-to-epoch differences of the cumulative ``seconds`` in the epoch records
(teleport epochs excluded, so the comparison is the training loop itself), and start-up is the
wall time outside the epochs (Ray: cluster start, worker group, process group). The in-process and driver
runs alternate (three rounds, medians over all) before Ray starts: the processes a stopped local Ray
leaves behind for a few seconds took a core from whatever ran right after it (the driver run measured
1.55x when it came after Ray, 1.04-1.11x before it). Floor:
Ray per-epoch time ≤ 1.15x the in-process one. A third runner is the loop a 1-worker service job
runs (its Ray job's driver, ``workers.on_ray.driver``: a checkpoint and Redis events per epoch); its floor:
≤ 1.05x the in-process one.

    python -m benchmarks.ray_overhead [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from api_schemas import build_spec
from benchmarks.common import print_table, verdict, wait_for_quiet, write_result

ROUNDS = 3  # in-process and driver runs, alternating (--quick: 1)


def epoch_deltas(records: list[dict[str, Any]], skip: set[int]) -> list[float]:
    """Seconds each epoch took (differences of the cumulative ``seconds``), epochs in ``skip`` left out."""
    epochs = [r for r in records if r.get("kind") == "epoch"]
    return [b["seconds"] - a["seconds"] for a, b in zip(epochs, epochs[1:], strict=False) if b["epoch"] not in skip]


def per_epoch(records: list[dict[str, Any]], skip: set[int]) -> float:
    return statistics.median(epoch_deltas(records, skip))


def run(epochs: int, hidden: list[int], max_train: int | None, cpus: int = 2, rounds: int = ROUNDS) -> dict[str, Any]:
    import ray

    from plots.curves import read_metrics
    from workers.on_ray.ray_train import run_on_ray
    from workers.train.loop import run_local

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    spec = build_spec({
        "model": {"kind": "mlp", "hidden": hidden}, "dataset": {"name": "digits", "max_train": max_train},
        "optimizer": {"name": "sgd", "lr": 0.05}, "training": {"epochs": epochs, "batch_size": 32},
        "teleport": {"epochs": [0], "batches": 4, "steps": 4},
        "resources": {"workers": 1, "cpus_per_worker": cpus},  # the threads of every runner (workers.train.loop.train)
    })
    out = Path(tempfile.mkdtemp(prefix="tl-rayovh"))
    results: dict[str, Any] = {}
    walls: dict[str, list[float]] = {"local": [], "driver": []}
    deltas: dict[str, list[float]] = {"local": [], "driver": []}
    for round_ in range(rounds):
        start = time.perf_counter()
        run_local(spec, out / f"local{round_}", progress=False)
        walls["local"].append(time.perf_counter() - start)
        local = read_metrics(out / f"local{round_}" / "metrics.jsonl")
        start = time.perf_counter()
        driver = run_driver(spec, out / f"driver{round_}")
        walls["driver"].append(time.perf_counter() - start)
        deltas["local"] += epoch_deltas(local, {0})
        deltas["driver"] += epoch_deltas(driver, {0})
    for name in ("local", "driver"):
        results[name] = {"wall": statistics.median(walls[name]), "per_epoch": statistics.median(deltas[name])}
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, configure_logging=False,
             _temp_dir=tempfile.mkdtemp(prefix="tlrayb", dir="/tmp"))
    try:
        start = time.perf_counter()
        run_on_ray(spec, out / "ray")
        wall = time.perf_counter() - start
    finally:
        ray.shutdown()
    remote = read_metrics(out / "ray" / "metrics.jsonl")
    results["ray"] = {"wall": wall, "per_epoch": per_epoch(remote, {0})}
    for r, recs in ((results["local"], local), (results["ray"], remote), (results["driver"], driver)):
        last = [x for x in recs if x.get("kind") == "epoch"][-1]
        r["epochs_seconds"] = last["seconds"]
        r["startup"] = r["wall"] - last["seconds"]
    ratio = results["ray"]["per_epoch"] / results["local"]["per_epoch"]
    job_ratio = results["driver"]["per_epoch"] / results["local"]["per_epoch"]
    print_table(["runner", "per-epoch s", "start-up s", "wall s"],
                [[k, f"{v['per_epoch']:.4f}", f"{v['startup']:.2f}", f"{v['wall']:.2f}"] for k, v in results.items()])
    print(f"Ray Train / in-process per epoch: {ratio:.3f}x — floor ≤ 1.15x: {verdict(ratio <= 1.15)}")
    print(f"a service job's loop (its driver: checkpoint and Redis events each epoch) / in-process per epoch: "
          f"{job_ratio:.3f}x — floor ≤ 1.05x: {verdict(job_ratio <= 1.05)}")
    return {"spec": spec.model_dump(mode="json"), "runs": results, "per_epoch_ratio": ratio,
            "job_per_epoch_ratio": job_ratio}


def run_driver(spec: Any, out: Path) -> list[dict[str, Any]]:
    """The loop a 1-worker service job runs (``workers.on_ray.tries.run_in_driver``: a checkpoint and Redis events per
    epoch) on a throwaway Redis; its epoch records as ``read_metrics`` gives them."""
    import subprocess

    import redis

    from api_schemas import keys
    from service.stack.embedded import free_port, redis_binary
    from workers.job.redis_sink import read_events
    from workers.on_ray.tries import run_in_driver

    port = free_port()
    # durable as the stack's Redis is (service.stack.embedded): every event fsynced before it is acknowledged
    server = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "yes", "--appendfsync", "always", "--dir", str(out.parent),
                               "--appendfilename", f"{out.name}.aof"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while not _answers(client):
            assert time.monotonic() < deadline, "the benchmark's Redis did not start"
            time.sleep(0.02)
        client.hset(keys.job("bench"), mapping={"spec": spec.model_dump_json(), "state": "running"})
        run_in_driver(spec, "bench", url, out, max_failures=0)
        return [{**e["data"], "kind": "epoch"} for e in read_events(url, "bench") if e["kind"] == "metric"]
    finally:
        server.terminate()
        server.wait()


def _answers(client: Any) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpus", type=int, default=2,
                        help="resources.cpus_per_worker: the torch threads of every runner (default 2; on a 2-core "
                             "machine 2 leaves no core for the checkpoint writer, Redis or Ray)")
    args = parser.parse_args(argv)
    if args.quick:
        result = {**run(3, [32], 200, args.cpus, rounds=1), "quick": True}
    else:
        wait_for_quiet()
        result = run(30, [512, 512], None, args.cpus)  # 3 x 29 epoch times per runner
    write_result("ray_overhead" if args.cpus == 2 else f"ray_overhead_{args.cpus}cpu", result)
    return result


if __name__ == "__main__":
    main()
