"""The service under load, on loopback: submissions/s, SSE fan-out, scheduling decision time, submit-to-first-epoch.

1. Submissions: an API-only stack (real Redis, the API process, no scheduler, a fixed simulated
   cluster) and one ``httpx.AsyncClient`` driving C concurrent clients that POST ``/v1/experiments``
   for a fixed time; throughput and p50/p99 latency per C. Floor: >= 300/s with p99 <= 50 ms.
2. SSE fan-out: N followers of one job's ``/events`` (in a child process) while a publisher XADDs
   metric events straight into the job's Redis stream at 100/s, then ``end``; each follower records
   receive time minus the event's ``sent_at``. Floor: every follower gets every event, p99 <= 100 ms.
3. Scheduling decision time: ``policy.decide`` alone, and ``Scheduler.decide`` end to end (reading
   the queue, users and usage from a real Redis), with 1,000 queued jobs from 10 users.
   Floor: <= 10 ms per decision.
4. Submit to first epoch on an idle local stack (Redis, Ray head, API, scheduler): the job's own
   event stream, timed by its Redis stream ids (the server's clock when each event was written),
   split into queue (submit -> starting), Ray job start (starting -> the worker's driver process
   reports running) and worker start (driver running -> first metric event).

The load generators run on the same machine (and cores) as the API and Redis: on a 2-core box the
numbers are for the whole system, client included. CPU seconds per process are reported per part.

    python -m benchmarks.service_bench [--quick] [--parts submit sse decide e2e]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from api_schemas import keys
from benchmarks.common import print_table, verdict, wait_for_quiet, write_result
from service.stack import Stack

# the simulated cluster the API-only stack checks submissions against (tests/service/conftest.py's)
STATIC_NODES = json.dumps([{"id": "n1", "cpus": 4, "gpus": 1}, {"id": "n2", "cpus": 4, "gpus": 1}])
TINY = {"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [32]},
        "training": {"epochs": 2, "batch_size": 64}, "teleport": {"enabled": False}}
PARTS = ("submit", "sse", "decide", "e2e")
LOADGEN_NOTE = ("the load generator (this process) shares the machine's cores with the API and Redis: "
                "client CPU time is part of what is measured")

FLOORS = {"submit_per_s": 300.0, "submit_p99_ms": 50.0, "sse_p99_ms": 100.0, "decision_ms": 10.0}


@dataclass
class Sizes:
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    submit_seconds: float = 5.0
    followers: int = 200
    events_per_s: float = 100.0
    sse_seconds: float = 10.0
    connect_batch: int = 25
    queued: int = 1000
    users: int = 10
    active: int = 12
    decide_repeats: int = 50
    e2e_jobs: int = 3
    e2e_timeout_s: float = 180.0

    @classmethod
    def quick(cls) -> Sizes:
        return cls(submit_seconds=2.0, followers=50, sse_seconds=3.0, decide_repeats=20, e2e_jobs=1,
                   e2e_timeout_s=120.0)


# ---- small helpers ------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); nan for no samples."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{1000 * x:.1f}"


CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(rest[11]) + int(rest[12])) / CLK  # fields 14 and 15: utime, stime


class CpuMeter:
    """CPU seconds used by this process and some child processes between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0: dict[str, float] = {}
        self.wall0 = 0.0

    def _now(self) -> dict[str, float]:
        out = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        out["loadgen"] = time.process_time()
        return out

    def start(self) -> CpuMeter:
        self.t0, self.wall0 = self._now(), time.perf_counter()
        return self

    def stop(self) -> dict[str, float]:
        now, wall = self._now(), time.perf_counter() - self.wall0
        out = {f"{k}_cpu_s": round(now[k] - self.t0[k], 3) for k in now}
        out["wall_s"] = round(wall, 3)
        return out


def api_only_stack(home: Path) -> Stack:
    stack = Stack(home, ray_address="http://127.0.0.1:9", extra_env={"TLAB_CLUSTER_NODES": STATIC_NODES})
    home.mkdir(parents=True, exist_ok=True)
    stack.start_redis()
    stack.ensure_admin()
    stack.start_service(("api",))
    return stack


# ---- 1. submissions -----------------------------------------------------------------------------


async def _one_client(client: httpx.AsyncClient, body: bytes, stop_at: float, lat: list[float],
                      errors: dict[int, int]) -> None:
    while time.perf_counter() < stop_at:
        t = time.perf_counter()
        r = await client.post("/v1/experiments", content=body)
        dt = time.perf_counter() - t
        if r.status_code == 201:
            lat.append(dt)
        else:
            errors[r.status_code] = errors.get(r.status_code, 0) + 1


async def _submit_load(url: str, token: str, concurrency: int, seconds: float, warmup_s: float = 1.0) -> dict[str, Any]:
    """``concurrency`` clients on one AsyncClient POSTing for ``seconds`` (after ``warmup_s`` not counted)."""
    body = json.dumps({"spec": TINY}).encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30, http1=True) as client:
        stop_at = time.perf_counter() + warmup_s
        await asyncio.gather(*(_one_client(client, body, stop_at, [], {}) for _ in range(concurrency)))
        lat: list[float] = []
        errors: dict[int, int] = {}
        start = time.perf_counter()
        stop_at = start + seconds
        await asyncio.gather(*(_one_client(client, body, stop_at, lat, errors) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "seconds": elapsed, "submitted": len(lat), "errors": errors,
            "per_s": len(lat) / elapsed, "p50_s": pct(lat, 0.5), "p90_s": pct(lat, 0.9), "p99_s": pct(lat, 0.99),
            "max_s": max(lat, default=math.nan)}


def bench_submissions(stack: Stack, sizes: Sizes) -> dict[str, Any]:
    rows = []
    for c in sizes.concurrency:  # one level at a time, so the CPU split is per level
        meter = CpuMeter({"api": stack.procs["api"].pid, "redis": stack.procs["redis"].pid}).start()
        row = asyncio.run(_submit_load(stack.url, stack.admin_token, c, sizes.submit_seconds,
                                       min(1.0, sizes.submit_seconds)))
        row["cpu"] = meter.stop()  # warm-up included
        rows.append(row)
    for r in rows:
        r["meets_floor"] = r["per_s"] >= FLOORS["submit_per_s"] and r["p99_s"] * 1000 <= FLOORS["submit_p99_ms"]
    print(f"\n1. submissions: POST /v1/experiments for {sizes.submit_seconds:g} s per concurrency level "
          f"(floor: >= {FLOORS['submit_per_s']:g}/s with p99 <= {FLOORS['submit_p99_ms']:g} ms)")
    print(f"   note: {LOADGEN_NOTE}")
    print_table(["clients", "submitted", "per s", "p50 ms", "p90 ms", "p99 ms", "max ms", "errors",
                 "CPU s api/redis/loadgen", "floor"],
                [[r["concurrency"], r["submitted"], f"{r['per_s']:.0f}", ms(r["p50_s"]), ms(r["p90_s"]),
                  ms(r["p99_s"]), ms(r["max_s"]), sum(r["errors"].values()),
                  f"{r['cpu']['api_cpu_s']:.1f}/{r['cpu']['redis_cpu_s']:.1f}/{r['cpu']['loadgen_cpu_s']:.1f}",
                  verdict(r["meets_floor"])] for r in rows])
    best = max(rows, key=lambda r: r["per_s"])
    ok = any(r["meets_floor"] for r in rows)
    print(f"   best: {best['per_s']:.0f}/s at {best['concurrency']} clients (p99 {ms(best['p99_s'])} ms); "
          f"floor {verdict(ok)}")
    return {"seconds_per_level": sizes.submit_seconds, "rows": rows, "meets_floor": ok, "note": LOADGEN_NOTE}


# ---- 2. SSE fan-out -----------------------------------------------------------------------------


def _parse_sse(block: bytes) -> tuple[str | None, str | None, str | None]:
    eid = event = data = None
    for line in block.split(b"\n"):
        if line.startswith(b"id:"):
            eid = line[3:].strip().decode()
        elif line.startswith(b"event:"):
            event = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            data = line[5:].strip().decode()
    return eid, event, data


async def _followers(url: str, token: str, job_id: str, n: int, batch: int, ready: Any,
                     deadline_s: float) -> dict[str, Any]:
    """``n`` followers on one AsyncClient, opened ``batch`` at a time (each batch waits for the previous
    one's first bytes); ``ready`` is set once every follower is in (or has failed)."""
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    timeout = httpx.Timeout(30.0, read=deadline_s)
    connected = 0

    async def follow(client: httpx.AsyncClient, settled: asyncio.Event) -> dict[str, Any]:
        nonlocal connected
        lat: list[float] = []
        epochs: set[int] = set()
        ended = False
        buf = b""
        nbytes = 0
        status: int | str = 200
        try:
            async with client.stream("GET", f"/v1/experiments/{job_id}/events") as resp:
                status = resp.status_code
                if status == 200:
                    async for chunk in resp.aiter_raw():
                        now = time.time()
                        if not settled.is_set():  # the API subscribed this follower before sending anything
                            connected += 1
                            settled.set()
                        buf += chunk
                        nbytes += len(chunk)
                        while b"\n\n" in buf:
                            block, buf = buf.split(b"\n\n", 1)
                            _eid, event, data = _parse_sse(block)
                            if event == "metric" and data:
                                d = json.loads(data)
                                lat.append(now - d["sent_at"])
                                epochs.add(int(d["epoch"]))
                            elif event == "end":
                                ended = True
                        if ended:
                            break
        except (httpx.HTTPError, asyncio.CancelledError) as err:
            status = repr(err)
        finally:
            settled.set()
        return {"status": status, "lat": lat, "epochs": len(epochs), "ended": ended, "bytes": nbytes,
                "closed_at": time.time()}

    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, limits=limits,
                                 timeout=timeout, http1=True) as client:
        t0 = time.perf_counter()
        tasks = []
        for first in range(0, n, batch):
            settled = [asyncio.Event() for _ in range(first, min(n, first + batch))]
            tasks += [asyncio.create_task(follow(client, ev)) for ev in settled]
            await asyncio.wait([asyncio.create_task(ev.wait()) for ev in settled], timeout=60)
        connect_s = time.perf_counter() - t0
        ready.set()
        cpu0 = time.process_time()
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        results = [t.result() if t in done else {"status": "timeout", "lat": [], "epochs": 0, "ended": False,
                                                  "bytes": 0, "closed_at": None} for t in tasks]
        cpu = time.process_time() - cpu0
    return {"connected": connected, "connect_s": connect_s, "followers_cpu_s": cpu, "results": results}


def _follower_proc(url: str, token: str, job_id: str, n: int, batch: int, ready: Any, out: Any,
                   deadline_s: float) -> None:
    res = asyncio.run(_followers(url, token, job_id, n, batch, ready, deadline_s))
    lat = [x for r in res["results"] for x in r["lat"]]
    out.put({"connected": res["connected"], "connect_s": res["connect_s"], "followers_cpu_s": res["followers_cpu_s"],
             "per_follower": [{k: r[k] for k in ("status", "epochs", "ended", "bytes", "closed_at")}
                              | {"n": len(r["lat"])} for r in res["results"]],
             "p50_s": pct(lat, 0.5), "p90_s": pct(lat, 0.9), "p99_s": pct(lat, 0.99),
             "max_s": max(lat, default=math.nan), "mean_s": statistics.fmean(lat) if lat else math.nan,
             "samples": len(lat)})


def _sse_once(stack: Stack, sizes: Sizes, batch: int) -> dict[str, Any]:
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.admin_token}"}, timeout=30) as c:
        r = c.post("/v1/experiments", json={"spec": TINY, "name": "sse-bench"})
        r.raise_for_status()
        job_id = r.json()["id"]
    n, rate, seconds = sizes.followers, sizes.events_per_s, sizes.sse_seconds
    count = int(rate * seconds)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no threads or sockets of ours inherited
    ready, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_follower_proc, args=(stack.url, stack.admin_token, job_id, n, batch, ready, out,
                                                     seconds + 60.0), daemon=True)
    proc.start()
    r_client = redis.Redis.from_url(stack.redis_url or "")
    key = keys.events(job_id)
    try:
        deadline = time.monotonic() + 120
        while not ready.wait(0.5):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the SSE followers did not connect (follower process exit code {proc.exitcode})")
        time.sleep(0.5)  # let the last subscriptions settle
        meter = CpuMeter({"api": stack.procs["api"].pid, "redis": stack.procs["redis"].pid}).start()
        start, wall_start = time.perf_counter(), time.time()
        late = 0.0
        for i in range(count):
            wait = start + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            else:
                late = max(late, -wait)
            r_client.xadd(key, {"kind": "metric",
                                "data": json.dumps({"kind": "epoch", "epoch": i, "sent_at": time.time()})})
        publish_s = time.perf_counter() - start
        r_client.xadd(key, {"kind": "end", "data": json.dumps({"kind": "end", "state": "succeeded"})})
        res = out.get(timeout=seconds + 120)
        cpu = meter.stop()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        r_client.close()
    per = res.pop("per_follower")
    complete = sum(1 for p in per if p["epochs"] == count and p["n"] == count and p["ended"])
    res.update({"job_id": job_id, "followers": n, "connect_batch": batch, "events": count, "events_per_s": rate,
                "publish_s": publish_s, "publisher_max_late_s": late, "followers_complete": complete,
                "missing_events": sum(count - p["epochs"] for p in per),
                "duplicates": sum(p["n"] - p["epochs"] for p in per),
                "not_ended": sum(1 for p in per if not p["ended"]),
                "errors": [p["status"] for p in per if p["status"] != 200][:5],
                "incomplete": [{"status": p["status"], "metric_events": p["epochs"], "ended": p["ended"],
                                "bytes": p["bytes"], "closed_after_publish_start_s":
                                    None if p["closed_at"] is None else round(p["closed_at"] - wall_start, 3)}
                               for p in per if p["epochs"] != count or not p["ended"]][:10],
                "cpu": cpu})
    res["every_event_delivered"] = complete == n
    res["meets_floor"] = res["every_event_delivered"] and res["p99_s"] * 1000 <= FLOORS["sse_p99_ms"]
    return res


def bench_sse(stack: Stack, sizes: Sizes) -> dict[str, Any]:
    """Twice, each on a fresh job: every follower connecting at once ("storm"), then in batches ("ramped")."""
    runs = {"storm": _sse_once(stack, sizes, sizes.followers),
            "ramped": _sse_once(stack, sizes, sizes.connect_batch)}
    n, count = sizes.followers, runs["storm"]["events"]
    print(f"\n2. SSE fan-out: {n} followers of one job, {count} events at {sizes.events_per_s:g}/s over "
          f"{sizes.sse_seconds:g} s (floor: every follower gets every event, p99 <= {FLOORS['sse_p99_ms']:g} ms); "
          f"followers connecting all at once, then {sizes.connect_batch} at a time")
    print("   note: the followers run in a child process on the same cores as the API, Redis and the publisher")
    print_table(["connect", "followers", "connect s", "complete", "missing", "not ended", "p50 ms", "p90 ms",
                 "p99 ms", "max ms", "CPU s api/redis/followers", "floor"],
                [[f"{mode} ({r['connect_batch']}/batch)", n, f"{r['connect_s']:.2f}", r["followers_complete"],
                  r["missing_events"], r["not_ended"], ms(r["p50_s"]), ms(r["p90_s"]), ms(r["p99_s"]),
                  ms(r["max_s"]), f"{r['cpu']['api_cpu_s']:.1f}/{r['cpu']['redis_cpu_s']:.1f}/"
                                  f"{r['followers_cpu_s']:.1f}", verdict(r["meets_floor"])]
                 for mode, r in runs.items()])
    for mode, r in runs.items():
        if r["incomplete"]:
            first = r["incomplete"][0]
            print(f"   {mode}: {n - r['followers_complete']} follower(s) incomplete, e.g. status {first['status']}, "
                  f"{first['metric_events']} metric events, {first['bytes']} bytes, stream closed "
                  f"{first['closed_after_publish_start_s']} s after publishing began (see api.log)")
    log = (stack.logs / "api.log").read_text(errors="replace") if (stack.logs / "api.log").exists() else ""
    api_errors = {"tracebacks": log.count("Traceback (most recent call last)"),
                  "redis_max_connections": log.count("MaxConnectionsError")}
    if any(api_errors.values()):
        print(f"   the API logged errors meanwhile: {api_errors}")
    return {**runs, "api_log_errors": api_errors, "meets_floor": all(r["meets_floor"] for r in runs.values())}


# ---- 3. scheduling decision time ----------------------------------------------------------------

DECIDE_NODES = [{"id": f"n{i}", "cpus": 8, "gpus": 2} for i in range(1, 5)]  # 4 nodes x 8 CPUs x 2 GPUs


def synthetic_load(sizes: Sizes, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Queued jobs (owner, priority, demand) and active jobs (owner, demand, placement) on DECIDE_NODES."""
    rng = random.Random(seed)
    users = [f"user{i}" for i in range(sizes.users)]
    queued = []
    for _ in range(sizes.queued):
        queued.append({"owner": rng.choice(users), "priority": rng.randint(0, 2),
                       "workers": rng.randint(1, 2), "gpus": 1.0 if rng.random() < 0.25 else 0.0})
    active = []
    for i in range(sizes.active):  # some of the cluster busy: a 1-CPU worker per slot, round robin
        node = DECIDE_NODES[i % len(DECIDE_NODES)]["id"]
        active.append({"owner": users[i % len(users)], "workers": 1, "gpus": 1.0 if i % 3 == 0 else 0.0,
                       "placement": [node]})
    return queued, active


def _time(fn: Any, repeats: int) -> tuple[list[float], Any]:
    samples, value = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        value = fn()
        samples.append(time.perf_counter() - t)
    return samples, value


def bench_decide(sizes: Sizes, home: Path) -> dict[str, Any]:
    from api_schemas.jobs import Demand, ExperimentSubmit, JobState, Quotas, UserCreate
    from service import policy
    from service.ray_cluster import StaticCluster
    from service.scheduler import Scheduler
    from service.settings import Settings
    from service.store import Store

    queued_spec, active_spec = synthetic_load(sizes)
    now = time.time()
    # pure policy.decide on in-memory inputs
    nodes = StaticCluster(DECIDE_NODES).nodes()
    queued = [policy.QueuedJob(f"q{i:05d}", q["owner"], q["priority"], now - sizes.queued + i,
                               Demand(workers=q["workers"], cpus_per_worker=1, gpus_per_worker=q["gpus"]))
              for i, q in enumerate(queued_spec)]
    active = [policy.ActiveJob(f"a{i:03d}", a["owner"], Demand(workers=1, cpus_per_worker=1, gpus_per_worker=a["gpus"]),
                               tuple(a["placement"])) for i, a in enumerate(active_spec)]
    owners = sorted({q["owner"] for q in queued_spec} | {a["owner"] for a in active_spec})
    quotas = {u: Quotas() for u in owners}
    usage = {u: 10.0 * i for i, u in enumerate(owners)}
    policy.decide(queued, active, nodes, usage, quotas)  # warm-up
    pure, decision = _time(lambda: policy.decide(queued, active, nodes, usage, quotas), sizes.decide_repeats)
    result: dict[str, Any] = {
        "queued": sizes.queued, "users": len(owners), "active": len(active), "nodes": DECIDE_NODES,
        "repeats": sizes.decide_repeats,
        "pure": {"median_s": statistics.median(pure), "p99_s": pct(pure, 0.99), "max_s": max(pure),
                 "starts": len(decision.starts), "waiting": len(decision.order)},
    }

    # Scheduler.decide end to end over a real Redis
    stack = Stack(home)
    home.mkdir(parents=True, exist_ok=True)
    try:
        stack.start_redis()
        store = Store.from_url(stack.redis_url or "")
        for u in owners:
            store.create_user(UserCreate(name=u))
        t = time.perf_counter()
        ids = []
        for q in queued_spec + [{"owner": a["owner"], "priority": 0, "workers": 1, "gpus": a["gpus"]}
                                for a in active_spec]:
            spec = dict(TINY, resources={"workers": q["workers"], "cpus_per_worker": 1, "gpus_per_worker": q["gpus"]})
            body = ExperimentSubmit.model_validate({"spec": spec, "priority": q["priority"]})
            ids.append(store.submit(q["owner"], body)[0])
        fill_s = time.perf_counter() - t
        for job_id, a in zip(ids[len(queued_spec):], active_spec, strict=True):
            assert store.transition(job_id, JobState.STARTING, expect=[JobState.QUEUED], ray_job_id=f"tlab-{job_id}-1",
                                    attempts="1", placement=json.dumps(a["placement"]))
        store.charge(usage, time.time(), 3600.0)
        settings = Settings(redis_url=stack.redis_url, cluster_nodes=json.dumps(DECIDE_NODES))
        sched = Scheduler(store, settings, StaticCluster(DECIDE_NODES), launcher=None)  # type: ignore[arg-type]
        cold, (d_cold, _n, _a) = _time(lambda: sched.decide(time.time()), 1)  # reads every queued job's hash once
        warm, (d, n_, a_) = _time(lambda: sched.decide(time.time()), sizes.decide_repeats)
        pub, _ = _time(lambda: sched.publish(d, n_, a_, time.time()), max(3, sizes.decide_repeats // 5))
        # the Redis reads alone, and decide with the cache of queued jobs' fields dropped every time
        reads, _ = _time(lambda: (sched.queued(), sched.active(), store.users(), store.usage(time.time(), 3600.0)),
                         sizes.decide_repeats)

        def uncached() -> object:
            sched.static.clear()
            return sched.decide(time.time())

        nocache, _ = _time(uncached, max(3, sizes.decide_repeats // 5))
        store.r.close()
    finally:
        stack.stop()
    result["scheduler"] = {
        "fill_s": fill_s, "queued_in_redis": len(queued_spec), "active_in_redis": len(active_spec),
        "cold_s": cold[0], "median_s": statistics.median(warm), "p99_s": pct(warm, 0.99), "max_s": max(warm),
        "redis_reads_median_s": statistics.median(reads),
        "uncached_median_s": statistics.median(nocache), "uncached_max_s": max(nocache),
        "publish_median_s": statistics.median(pub),
        "starts": len(d.starts), "waiting": len(d.order), "same_as_cold": [j.id for j, _ in d_cold.starts]
        == [j.id for j, _ in d.starts],
    }
    floor = FLOORS["decision_ms"] / 1000
    result["meets_floor"] = result["pure"]["p99_s"] <= floor and result["scheduler"]["p99_s"] <= floor
    s = result["scheduler"]
    print(f"\n3. scheduling decision: {sizes.queued} queued jobs of {len(owners)} users, {len(active)} active, "
          f"{len(DECIDE_NODES)} nodes x (8 CPUs, 2 GPUs); {sizes.decide_repeats} repeats "
          f"(floor: <= {FLOORS['decision_ms']:g} ms per decision)")
    print_table(["what", "median ms", "p99 ms", "max ms", "starts", "waiting"],
                [["policy.decide (pure)", ms(result["pure"]["median_s"]), ms(result["pure"]["p99_s"]),
                  ms(result["pure"]["max_s"]), result["pure"]["starts"], result["pure"]["waiting"]],
                 ["Scheduler.decide (Redis, warm cache)", ms(s["median_s"]), ms(s["p99_s"]), ms(s["max_s"]),
                  s["starts"], s["waiting"]],
                 ["  its Redis reads alone", ms(s["redis_reads_median_s"]), "", "", "", ""],
                 ["Scheduler.decide, first call (cold)", ms(s["cold_s"]), "", "", "", ""],
                 ["Scheduler.decide, queued-job cache dropped", ms(s["uncached_median_s"]), "",
                  ms(s["uncached_max_s"]), "", ""],
                 ["Scheduler.publish (queue view + cluster)", ms(s["publish_median_s"]), "", "", "", ""]])
    print(f"   floor (pure and warm Scheduler.decide p99): {verdict(result['meets_floor'])}")
    return result


# ---- 4. submit to first epoch ------------------------------------------------------------------


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
            deadline = time.monotonic() + 60
            while True:  # idle and ready: the scheduler has ticked and sees the Ray node's CPUs
                r = client.get("/v1/cluster")
                if r.status_code == 200 and r.json()["scheduler_alive"] and r.json()["cpus_free"] > 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the scheduler did not report the Ray node within 60 s")
                time.sleep(0.1)
            ready_s = time.perf_counter() - t
            for i in range(sizes.e2e_jobs):
                sent = time.time()
                r = client.post("/v1/experiments", json={"spec": E2E_SPEC, "name": f"e2e-{i}"})
                got = time.time()
                r.raise_for_status()
                job_id = r.json()["id"]
                try:
                    f = follow_job(client, job_id, timeout_s=sizes.e2e_timeout_s)
                except (TimeoutError, httpx.HTTPError) as err:  # say why, keep the other parts' results
                    log = (stack.logs / "scheduler.log").read_text()[-1500:]
                    error = f"{err!r}; scheduler log tail: {log}"
                    print(f"   job {i + 1} {job_id} did not finish: {err!r}", flush=True)
                    break
                marks = {"submit_sent": sent, "submit_response": got, **f["marks"]}
                seg = {name: (marks[b] - marks[a] if a in marks and b in marks else None) for name, a, b in SEGMENTS}
                lag = {k: f["received"][k] - f["marks"][k] for k in f["marks"]}
                timeline = [[round(t - sent, 3), ev, d] for t, ev, d in f["timeline"]]
                jobs.append({"job_id": job_id, "final": f["final"], "marks": marks, "segments": seg,
                             "receive_lag_s": lag, "timeline_s": timeline})
                print(f"   job {i + 1}/{sizes.e2e_jobs} {job_id}: {f['final']}, submit -> first epoch "
                      f"{ms(seg['total: submit -> first epoch'])} ms", flush=True)
    finally:
        stack.stop()
        shutil.rmtree(home, ignore_errors=True)
    medians = {}
    for name, _a, _b in SEGMENTS:
        vals = [j["segments"][name] for j in jobs if j["segments"][name] is not None]
        medians[name] = statistics.median(vals) if vals else None
    print(f"\n4. submit to first epoch on an idle local stack (Redis, Ray head with 2 CPUs, API, scheduler ticking "
          f"every 0.2 s); {len(jobs)} job(s) one after another; times from the events' Redis stream ids")
    print(f"   stack start-up: {startup_s:.1f} s (until the scheduler sees the Ray node: {ready_s:.1f} s)")
    if error:
        print(f"   ERROR: {error[:300]}")
    print_table(["segment", "median ms"] + [f"job {i + 1}" for i in range(len(jobs))],
                [[name, ms(medians[name])] + [ms(j["segments"][name]) for j in jobs] for name, _a, _b in SEGMENTS])
    return {"stack_startup_s": startup_s, "ready_s": ready_s, "error": error, "spec": E2E_SPEC, "tick_s": 0.2,
            "jobs": jobs, "median_s": medians,
            "all_succeeded": error is None and all(j["final"] == "succeeded" for j in jobs)}


# ---- main ------------------------------------------------------------------------------------------


def run(sizes: Sizes, parts: tuple[str, ...] = PARTS, quick: bool = False) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="tl-svcb"))
    result: dict[str, Any] = {"sizes": asdict(sizes), "parts": list(parts), "floors": FLOORS}
    try:
        if "submit" in parts or "sse" in parts:
            stack = api_only_stack(root / "api")
            try:
                if "submit" in parts:
                    result["submissions"] = bench_submissions(stack, sizes)
                if "sse" in parts:
                    result["sse"] = bench_sse(stack, sizes)
            finally:
                stack.stop()
        if "decide" in parts:
            result["decisions"] = bench_decide(sizes, root / "decide")
        if "e2e" in parts:
            result["submit_to_first_epoch"] = bench_e2e(sizes, root / "e2e")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    verdicts = {k: result[p]["meets_floor"] for k, p in
                [("submissions", "submissions"), ("sse", "sse"), ("decisions", "decisions")] if p in result}
    result["verdicts"] = verdicts
    if verdicts:
        print("\nfloors: " + ", ".join(f"{k} {verdict(v)}" for k, v in verdicts.items()))
    if quick:
        result["quick"] = True
    return result


def main(argv: list[str] | None = None, sizes: Sizes | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter runs, fewer followers, one end-to-end job")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    args = parser.parse_args(argv)
    if sizes is None:
        sizes = Sizes.quick() if args.quick else Sizes()
    if not args.quick:
        wait_for_quiet()
    result = run(sizes, tuple(args.parts), quick=args.quick)
    write_result("service", result)
    return result


if __name__ == "__main__":
    main()
