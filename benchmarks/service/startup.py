"""Part 4, submit to first epoch on an idle local stack (Redis, Ray head, API, scheduler): the job's own
event stream, timed by its Redis stream ids (the server's clock when each event was written), split into
queue (submit -> starting), Ray job start (starting -> the worker's driver process reports running) and
worker start (driver running -> first metric); and the driver's start-up timeline (``TIMELINE``): the times it
passed each phase (process spawned, light imports, a gang's ranks asked of Ray, torch imported, process group
formed, dataset loaded, model built, first checkpoint written: ``workers.train.startup``, sent with the ``finished``
event), between the stream's ``starting``, loop ``start`` and first ``metric`` events. One host: one clock.

Side by side in one run (``MODES``): a stack whose scheduler sets ``TLAB_IN_DRIVER=0`` (every job a
TorchTrainer, the earlier path) with 1-worker jobs, and a default stack (a 1-worker job trains in its
Ray job's driver, ``workers.on_ray.driver``) with 1- and 2-worker jobs; each against the floors (``FLOORS_S``)."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import print_table, verdict
from benchmarks.service.common import Sizes, ms
from service.stack.embedded import Stack


def _stream_time(eid: str) -> float:
    return int(eid.partition("-")[0]) / 1000.0


def follow_job(client: httpx.Client, job_id: str, timeout_s: float = 180.0) -> dict[str, Any]:
    """The job's events until ``end``: server time (stream id) and receive time of the milestones."""
    marks: dict[str, float] = {}
    received: dict[str, float] = {}
    timeline: list[list[Any]] = []
    final, startup = None, {}
    deadline = time.monotonic() + timeout_s
    with client.stream("GET", f"/v1/experiments/{job_id}/events", timeout=httpx.Timeout(30.0, read=timeout_s)) as r:
        r.raise_for_status()
        eid = event = data = None
        for line in r.iter_lines():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} did not end within {timeout_s:.0f} s")
            if line.startswith("id:"):
                eid = line[3:].strip()
            elif line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
            elif line == "" and eid and event:
                d = json.loads(data or "{}")
                name = None
                if event == "status" and d.get("state") == "starting":
                    name = "starting"
                elif event == "status" and d.get("state") == "running":
                    name = "driver_running" if "pid" in d else "scheduler_running"
                elif event == "status" and d.get("kind") == "start":
                    name = "train_start"
                elif event == "metric":
                    name = "first_metric"
                elif event == "end":
                    name, final = "end", d.get("state")
                elif event == "status" and d.get("state") in ("failed", "cancelled", "succeeded"):
                    final = d.get("state")
                if event == "status" and d.get("state") == "finished":
                    startup = d.get("startup") or {}  # the driver's phases (workers.train.startup)
                timeline.append([_stream_time(eid), event, {k: v for k, v in d.items() if k in TIMELINE_FIELDS}])
                if name and name not in marks:
                    marks[name] = _stream_time(eid)
                    received[name] = time.time()
                if event == "end":
                    break
                eid = event = data = None
    return {"marks": marks, "received": received, "final": final, "timeline": timeline, "startup": startup}


TIMELINE_FIELDS = ("kind", "state", "epoch", "level", "message", "reason", "pid")
E2E_SPEC = {"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [32]},
            "training": {"epochs": 2, "batch_size": 64}, "teleport": {"enabled": False}}
SEGMENTS = [  # name, from, to
    ("submit (API)", "submit_sent", "submit_response"),
    ("queue: submit -> starting", "submit_sent", "starting"),
    ("Ray job start: starting -> driver running", "starting", "driver_running"),
    ("  (scheduler sees Ray RUNNING: starting ->)", "starting", "scheduler_running"),
    ("worker start: driver running -> first epoch", "driver_running", "first_metric"),
    ("total: submit -> first epoch", "submit_sent", "first_metric"),
    ("rest: first epoch -> end", "first_metric", "end"),
]
# the start-up timeline, one step per mark: (row, mark, from the latest of these present); stream marks and the
# driver's phases (workers.train.startup.PHASES) together. A path that skips a phase shows "-" and its time goes to the
# next row (a TorchTrainer's controller, worker group, data and model: "loop set up")
TIMELINE = [
    ("scheduler: submit -> starting", "starting", ("submit_sent",)),
    ("Ray starts the driver process", "spawned", ("starting",)),
    ("python + light imports", "driver", ("spawned",)),
    ("gang: ray.init + other ranks asked of Ray", "ranks", ("driver",)),
    ("import torch and the loop", "torch", ("ranks", "driver")),
    ("gang: ranks start + process group", "group", ("torch",)),
    ("dataset load", "data", ("group", "torch")),
    ("model build", "model", ("data",)),
    ("loop set up (restore, DDP wrap; TorchTrainer: all)", "train_start", ("model", "torch")),
    ("first epoch", "first_metric", ("train_start",)),
    ("  first checkpoint written (after it, in the background)", "checkpoint", ("first_metric",)),
]


def timeline_segments(marks: dict[str, float]) -> dict[str, float | None]:
    """Each ``TIMELINE`` row's seconds: its mark minus the latest of its ``from`` marks present (None if absent)."""
    out: dict[str, float | None] = {}
    for row, mark, starts in TIMELINE:
        start = next((marks[m] for m in starts if m in marks), None)
        out[row] = marks[mark] - start if mark in marks and start is not None else None
    return out


def _wait_ready(client: httpx.Client, timeout_s: float = 60.0, idle: bool = False) -> None:
    """Ready: the scheduler has ticked and sees the Ray node's CPUs; ``idle``: all of them free (the previous
    job's CPUs released, as Ray reports them: its report lags a few seconds after a job ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.get("/v1/cluster")
        view = r.json() if r.status_code == 200 else {}
        if view.get("scheduler_alive") and view["cpus_free"] > 0 and (
                not idle or view["cpus_free"] >= view["cpus_total"]):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler did not report the Ray node {'idle ' if idle else ''}within "
                               f"{timeout_s:g} s")
        time.sleep(0.1)


def _one_job(client: httpx.Client, spec: dict[str, Any], name: str,
             timeout_s: float) -> tuple[str, dict[str, Any] | Exception]:
    """Submit one job and follow it to its end: (job id, its record), or (job id, why it did not finish)."""
    sent = time.time()
    r = client.post("/v1/experiments", json={"spec": spec, "name": name})
    got = time.time()
    r.raise_for_status()
    job_id = r.json()["id"]
    try:
        f = follow_job(client, job_id, timeout_s=timeout_s)
    except (TimeoutError, httpx.HTTPError) as err:
        return job_id, err
    marks = {"submit_sent": sent, "submit_response": got, **f["marks"], **f["startup"]}
    seg = {name: (marks[b] - marks[a] if a in marks and b in marks else None) for name, a, b in SEGMENTS}
    seg.update(timeline_segments(marks))
    lag = {k: f["received"][k] - f["marks"][k] for k in f["marks"]}
    timeline = [[round(t - sent, 3), ev, d] for t, ev, d in f["timeline"]]
    return job_id, {"job_id": job_id, "final": f["final"], "marks": marks, "segments": seg, "startup": f["startup"],
                    "receive_lag_s": lag, "timeline_s": timeline}


def _spec(workers: int) -> dict[str, Any]:
    return {**E2E_SPEC, "resources": {"workers": workers, "cpus_per_worker": 1}}


def _run_mode(sizes: Sizes, home: Path, label: str, env: dict[str, str], workers: tuple[int, ...]) -> dict[str, Any]:
    """One stack (its scheduler's environment picks the path); ``sizes.e2e_jobs`` jobs per worker count."""
    stack = Stack(home, num_cpus=2, tick_s=0.2, extra_env=env)
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in workers}
    load_before = os.getloadavg()[0]  # on a shared machine: how far from idle these timings are
    error = None
    startup_s = ready_s = math.nan
    try:
        t = time.perf_counter()
        stack.start()
        startup_s = time.perf_counter() - t
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.admin_token}"},
                          timeout=60) as client:
            _wait_ready(client)
            ready_s = time.perf_counter() - t
            for w in workers:
                for i in range(sizes.e2e_jobs):
                    _wait_ready(client, idle=True)  # "on an idle cluster": not the previous job's release lag
                    job_id, job = _one_job(client, _spec(w), f"e2e-{w}w-{i}", sizes.e2e_timeout_s)
                    if isinstance(job, Exception):  # say why, keep the other parts' results
                        log = (stack.logs / "scheduler.log").read_text()[-1500:]
                        error = f"{job!r}; scheduler log tail: {log}"
                        print(f"   {label}, {w} worker(s), job {i + 1} {job_id} did not finish: {job!r}", flush=True)
                        break
                    runs[w].append(job)
                    print(f"   {label}, {w} worker(s), job {i + 1}/{sizes.e2e_jobs} {job_id}: {job['final']}, "
                          f"submit -> first epoch {ms(job['segments']['total: submit -> first epoch'])} ms",
                          flush=True)
    finally:
        stack.stop()
        shutil.rmtree(home, ignore_errors=True)
    return {"label": label, "env": env, "stack_startup_s": startup_s, "ready_s": ready_s, "error": error,
            "load_1min": [load_before, os.getloadavg()[0]],
            "by_workers": {str(w): {"jobs": jobs, "median_s": _medians(jobs)} for w, jobs in runs.items()}}


def _medians(jobs: list[dict[str, Any]]) -> dict[str, float | None]:
    out = {}
    for name in [*(n for n, _a, _b in SEGMENTS), *(n for n, _m, _f in TIMELINE)]:
        vals = [j["segments"][name] for j in jobs if j["segments"].get(name) is not None]
        out[name] = statistics.median(vals) if vals else None
    return out


# (label, the scheduler's extra environment, worker counts): the TorchTrainer path first, as it was before
MODES = [("TorchTrainer (TLAB_IN_DRIVER=0)", {"TLAB_IN_DRIVER": "0"}, (1,)), ("default", {}, (1, 2))]
FLOORS_S = {"1": 5.0, "2": 8.0}  # submit -> first epoch, median, 1 and 2 workers


def bench_e2e(sizes: Sizes, home: Path) -> dict[str, Any]:
    modes = [_run_mode(sizes, home / f"m{i}", label, env, workers) for i, (label, env, workers) in enumerate(MODES)]
    base, default = modes[0], modes[-1]
    total = "total: submit -> first epoch"
    floors = {w: {"floor_s": f, "median_s": default["by_workers"][w]["median_s"][total]}
              for w, f in FLOORS_S.items()}
    for row in floors.values():
        row["meets_floor"] = row["median_s"] is not None and row["median_s"] <= row["floor_s"]
    one = default["by_workers"]["1"]
    errors = [m["error"] for m in modes if m["error"]]
    result = {"spec": E2E_SPEC, "tick_s": 0.2, "modes": modes, "floors": floors,
              # the default path, 1 worker (the shape this part had before the modes)
              "stack_startup_s": default["stack_startup_s"], "ready_s": default["ready_s"], "jobs": one["jobs"],
              "median_s": one["median_s"], "error": "; ".join(errors) or None,
              "all_succeeded": not errors and all(j["final"] == "succeeded" for m in modes
                                                  for r in m["by_workers"].values() for j in r["jobs"])}
    before, after = base["by_workers"]["1"]["median_s"][total], one["median_s"][total]
    result["one_worker_speedup"] = before / after if before and after else None
    _print_e2e(modes, floors, result["one_worker_speedup"])
    return result


def _print_e2e(modes: list[dict[str, Any]], floors: dict[str, dict[str, Any]], speedup: float | None) -> None:
    print("\n4. submit to first epoch on an idle local stack (Redis, Ray head with 2 CPUs, API, scheduler ticking "
          "every 0.2 s); jobs one after another; times from the events' Redis stream ids; medians")
    columns = [(m, w) for m in modes for w in m["by_workers"]]
    for m in modes:
        print(f"   {m['label']}: stack start-up {m['stack_startup_s']:.1f} s (until the scheduler sees the Ray node: "
              f"{m['ready_s']:.1f} s); 1-min load {m['load_1min'][0]:.1f} before, {m['load_1min'][1]:.1f} after"
              + (f"; ERROR: {m['error'][:300]}" if m["error"] else ""))
    print_table(["segment"] + [f"{m['label']}, {w} worker(s) ms" for m, w in columns],
                [[name] + [ms(m["by_workers"][w]["median_s"][name]) for m, w in columns] for name, _a, _b in SEGMENTS])
    print("   start-up timeline (the driver's phases, workers.train.startup; each row from the one before it present)")
    print_table(["step"] + [f"{m['label']}, {w} worker(s) ms" for m, w in columns],
                [[name] + [ms(m["by_workers"][w]["median_s"].get(name)) for m, w in columns]
                 for name, _m, _f in TIMELINE])
    if speedup:
        print(f"   1 worker, submit -> first epoch: TorchTrainer / default = {speedup:.2f}x")
    print("   floors: " + ", ".join(f"{w} worker(s) {ms(r['median_s'])} ms <= {1000 * r['floor_s']:.0f} ms "
                                     f"{verdict(r['meets_floor'])}" for w, r in floors.items()))
