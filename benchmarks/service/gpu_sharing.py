"""Shared GPUs through the service, for a GPU machine: ``tlab up`` (Ray finds the GPUs), then over REST

  [1] a gang of 2 workers x 0.5 GPU: two DDP ranks on one card, their process group on gloo;
  [2] a sweep of 4 trials x 0.25 GPU, all 4 at once on one card, each fenced to a quarter of its memory.

Each is checked as a user would: it succeeded, every epoch reached the stream once, each rank's log says the
backend it joined on and the card Ray gave it (one card for both), the job's summary its device and peak GPU
memory, and the trials' epochs overlapped in time (their stream ids are millisecond stamps). ``--device cpu`` is the
dry run on a machine without GPUs: the head advertises ``--num-gpus 1`` and the jobs train on the CPU.
Figures go to ``<results>/<gpu>/gpu_sharing.json`` (``<gpu>``: the card's model, e.g. ``h100``; ``cpu``).

    python -m benchmarks.service.gpu_sharing [--device cuda|cpu] [--epochs 4]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, results_dir, write_result
from service.cli.client import Client, Event

DIGITS = {"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [256, 256]},
          "teleport": {"enabled": True, "epochs": [0, 1], "batches": 2, "steps": 4}}
JOINED = re.compile(r"rank (\d) of \d+ joined on (\w+) \((\S+); .*CUDA_VISIBLE_DEVICES=(\S+)\)")


def gpu_name(device: str) -> str:
    """The card's model as a folder name (``NVIDIA H100 80GB HBM3`` -> ``h100``), ``cpu`` for the dry run."""
    if device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0)
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]*)\b", name)
    return (found.group(1) if found else re.sub(r"\W+", "-", name)).lower()


@contextmanager
def tlab_up(home: Path, device: str, cpus: int) -> Iterator[Client]:
    """``tlab up`` as a user starts it (its own Redis and Ray head), stopped with Ctrl-C on the way out."""
    args = ["--num-cpus", str(cpus)] + (["--num-gpus", "1"] if device == "cpu" else [])
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS", "RAY_AUTH_MODE")}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "up", "--home", str(home), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url, deadline = "", time.monotonic() + 180
        while not url and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline() if proc.stdout else ""
            url = line.split()[-1] if line.startswith("Teleport Lab is up at ") else ""
        if not url:
            raise RuntimeError(f"tlab up did not come up: see {home / 'logs'}")
        with Client(url, (home / "admin.token").read_text().strip()) as c:
            wait_for_gpus(c)
            yield c
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)


def wait_for_gpus(c: Client, timeout_s: float = 60) -> None:
    """Until the scheduler has reported a node with GPUs (jobs asking for a share are refused before)."""
    deadline = time.monotonic() + timeout_s
    while c.json("GET", "/v1/cluster")["gpus_total"] <= 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the scheduler reports no GPU: does Ray see one (nvidia-smi, ray status)?")
        time.sleep(0.5)


def spec(device: str, epochs: int, **resources: Any) -> dict[str, Any]:
    training = {"epochs": epochs, "batch_size": 64, "device": "cpu" if device == "cpu" else "cuda"}
    return {**DIGITS, "training": training, "resources": resources}


def stamp(event: Event) -> float:
    """The seconds a stream event was written at (its id is ``<ms>-<seq>``)."""
    return int(event.id.split("-")[0]) / 1000.0


def gang(c: Client, device: str, epochs: int) -> dict[str, Any]:
    """[1] 2 workers x 0.5 GPU: every epoch once, the ranks' backend and cards from their logs."""
    t0 = time.monotonic()
    job = c.submit(spec(device, epochs, workers=2, gpus_per_worker=0.5, cpus_per_worker=1), name="gang-2x0.5")["id"]
    events = list(c.events(job))
    view = c.get(job)
    ranks = {k: JOINED.search(c.logs(job, rank=k)) for k in ("0", "1")}
    joined = {k: {"backend": m.group(2), "device": m.group(3), "cuda_visible_devices": m.group(4)}
              for k, m in ranks.items() if m}
    epochs_seen = [e.data["epoch"] for e in events if e.kind == "metric"]
    return {"job": job, "state": view["state"], "failure": view.get("failure_reason"), "epochs": epochs_seen,
            "every_epoch_once": epochs_seen == list(range(epochs)), "ranks": joined,
            "one_card": len({r["cuda_visible_devices"] for r in joined.values()}) == 1 and len(joined) == 2,
            "summary": view.get("summary"), "seconds": round(time.monotonic() - t0, 1)}


def overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals running at one moment."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])  # at one moment: ends first
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def sweep(c: Client, device: str, epochs: int) -> dict[str, Any]:
    """[2] 4 trials x 0.25 GPU at once: every trial's epochs once, and how many trained at the same time."""
    t0 = time.monotonic()
    body = {"base": spec(device, epochs, workers=1, gpus_per_worker=0.25, cpus_per_worker=0.5),
            "search_space": {"optimizer.lr": {"grid": [0.01, 0.03, 0.1, 0.3]}}, "max_concurrent_trials": 4,
            "name": "sweep-4x0.25"}
    job = c.json("POST", "/v1/sweeps", json=body)["id"]
    events = list(c.events(job))
    view = c.json("GET", f"/v1/sweeps/{job}")
    tagged: dict[str, list[Event]] = {}  # each trial's events, from its loop's start to its summary
    for e in events:
        if isinstance(e.data, dict) and e.data.get("trial"):
            tagged.setdefault(e.data["trial"], []).append(e)
    spans = {trial: (stamp(es[0]), stamp(es[-1])) for trial, es in tagged.items()}
    epochs_of = {trial: [e.data["epoch"] for e in es if e.kind == "metric"] for trial, es in tagged.items()}
    first = min((a for a, _ in spans.values()), default=0.0)
    return {"job": job, "state": view["job"]["state"], "failure": view["job"].get("failure_reason"),
            "trials": [{"trial": t["trial"], "state": t["state"], "epochs": t["epochs"],
                        "trained_s": [round(x - first, 2) for x in spans.get(t["trial"], ())]} for t in view["trials"]],
            "every_epoch_once": len(epochs_of) == 4 and all(e == list(range(epochs)) for e in epochs_of.values()),
            "most_at_once": overlap(list(spans.values())), "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--cpus", type=int, default=min(8, os.cpu_count() or 2), help="CPUs the Ray head offers")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tlab-gpu-sharing-") as home, \
            tlab_up(Path(home), args.device, args.cpus) as c:
        result = {"device": args.device, "epochs": args.epochs, "gang": gang(c, args.device, args.epochs),
                  "sweep": sweep(c, args.device, args.epochs)}
    g, s = result["gang"], result["sweep"]
    print_table(["run", "state", "every epoch once", "detail", "seconds"], [
        ["2 x 0.5 GPU gang", g["state"], g["every_epoch_once"],
         f"{'one card' if g['one_card'] else 'cards differ'}; "
         f"{', '.join(sorted({r['backend'] for r in g['ranks'].values()}))}; peak "
         f"{(g['summary'] or {}).get('gpu_memory_peak_mb', '-')} MiB", g["seconds"]],
        ["4 x 0.25 GPU sweep", s["state"], s["every_epoch_once"], f"{s['most_at_once']} trials at once",
         s["seconds"]]])
    write_result("gpu_sharing", result, results_dir() / gpu_name(args.device))
    ok = g["state"] == s["state"] == "succeeded" and g["every_epoch_once"] and s["every_epoch_once"]
    if not ok:
        raise SystemExit(f"FAIL: gang {g['state']} ({g['failure']}), sweep {s['state']} ({s['failure']})")
    return result


if __name__ == "__main__":
    main()
