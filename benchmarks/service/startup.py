"""Part 4, submit to first epoch on an idle local stack (Redis, Ray head, API, scheduler): the job's own
event stream, timed by its Redis stream ids (the server's clock when each event was written), split into
queue (submit -> starting), Ray job start (starting -> the worker's driver process reports running) and
worker start (driver running -> first metric event)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import print_table
from benchmarks.service.common import Sizes, ms
from service.stack import Stack


def _stream_time(eid: str) -> float:
    return int(eid.partition("-")[0]) / 1000.0


def follow_job(client: httpx.Client, job_id: str, timeout_s: float = 180.0) -> dict[str, Any]:
    """The job's events until ``end``: server time (stream id) and receive time of the milestones."""
    marks: dict[str, float] = {}
    received: dict[str, float] = {}
    timeline: list[list[Any]] = []
    final = None
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
                elif event == "metric":
                    name = "first_metric"
                elif event == "end":
                    name, final = "end", d.get("state")
                elif event == "status" and d.get("state") in ("failed", "cancelled", "succeeded"):
                    final = d.get("state")
                timeline.append([_stream_time(eid), event, {k: v for k, v in d.items() if k in TIMELINE_FIELDS}])
                if name and name not in marks:
                    marks[name] = _stream_time(eid)
                    received[name] = time.time()
                if event == "end":
                    break
                eid = event = data = None
    return {"marks": marks, "received": received, "final": final, "timeline": timeline}


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


def _wait_ready(client: httpx.Client, timeout_s: float = 60.0) -> None:
    """Idle and ready: the scheduler has ticked and sees the Ray node's CPUs."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.get("/v1/cluster")
        if r.status_code == 200 and r.json()["scheduler_alive"] and r.json()["cpus_free"] > 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the scheduler did not report the Ray node within 60 s")
        time.sleep(0.1)


def _one_job(client: httpx.Client, i: int, timeout_s: float) -> tuple[str, dict[str, Any] | Exception]:
    """Submit one job and follow it to its end: (job id, its record), or (job id, why it did not finish)."""
    sent = time.time()
    r = client.post("/v1/experiments", json={"spec": E2E_SPEC, "name": f"e2e-{i}"})
    got = time.time()
    r.raise_for_status()
    job_id = r.json()["id"]
    try:
        f = follow_job(client, job_id, timeout_s=timeout_s)
    except (TimeoutError, httpx.HTTPError) as err:
        return job_id, err
    marks = {"submit_sent": sent, "submit_response": got, **f["marks"]}
    seg = {name: (marks[b] - marks[a] if a in marks and b in marks else None) for name, a, b in SEGMENTS}
    lag = {k: f["received"][k] - f["marks"][k] for k in f["marks"]}
    timeline = [[round(t - sent, 3), ev, d] for t, ev, d in f["timeline"]]
    return job_id, {"job_id": job_id, "final": f["final"], "marks": marks, "segments": seg,
                    "receive_lag_s": lag, "timeline_s": timeline}


def bench_e2e(sizes: Sizes, home: Path) -> dict[str, Any]:
    stack = Stack(home, num_cpus=2, tick_s=0.2)
    jobs: list[dict[str, Any]] = []
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
            for i in range(sizes.e2e_jobs):
                job_id, job = _one_job(client, i, sizes.e2e_timeout_s)
                if isinstance(job, Exception):  # say why, keep the other parts' results
                    log = (stack.logs / "scheduler.log").read_text()[-1500:]
                    error = f"{job!r}; scheduler log tail: {log}"
                    print(f"   job {i + 1} {job_id} did not finish: {job!r}", flush=True)
                    break
                jobs.append(job)
                print(f"   job {i + 1}/{sizes.e2e_jobs} {job_id}: {job['final']}, submit -> first epoch "
                      f"{ms(job['segments']['total: submit -> first epoch'])} ms", flush=True)
    finally:
        stack.stop()
        shutil.rmtree(home, ignore_errors=True)
    medians = {}
    for name, _a, _b in SEGMENTS:
        vals = [j["segments"][name] for j in jobs if j["segments"][name] is not None]
        medians[name] = statistics.median(vals) if vals else None
    _print_e2e(jobs, medians, startup_s, ready_s, error)
    return {"stack_startup_s": startup_s, "ready_s": ready_s, "error": error, "spec": E2E_SPEC, "tick_s": 0.2,
            "jobs": jobs, "median_s": medians,
            "all_succeeded": error is None and all(j["final"] == "succeeded" for j in jobs)}


def _print_e2e(jobs: list[dict[str, Any]], medians: dict[str, float | None], startup_s: float, ready_s: float,
               error: str | None) -> None:
    print(f"\n4. submit to first epoch on an idle local stack (Redis, Ray head with 2 CPUs, API, scheduler ticking "
          f"every 0.2 s); {len(jobs)} job(s) one after another; times from the events' Redis stream ids")
    print(f"   stack start-up: {startup_s:.1f} s (until the scheduler sees the Ray node: {ready_s:.1f} s)")
    if error:
        print(f"   ERROR: {error[:300]}")
    print_table(["segment", "median ms"] + [f"job {i + 1}" for i in range(len(jobs))],
                [[name, ms(medians[name])] + [ms(j["segments"][name]) for j in jobs] for name, _a, _b in SEGMENTS])
