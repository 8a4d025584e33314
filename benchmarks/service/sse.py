"""Part 2, SSE fan-out: N followers of one job's ``/events`` (in a child process) while a publisher XADDs
metric events straight into the job's Redis stream at 100/s, then ``end``; each follower records receive
time minus the event's ``sent_at``. Floor: every follower gets every event, p99 <= 100 ms."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import statistics
import time
from typing import Any

import httpx
import redis

from api_schemas import keys
from api_schemas.jobs import JobState
from benchmarks.common import print_table, verdict
from benchmarks.service.common import FLOORS, TINY, CpuMeter, Sizes, ms, pct
from service.core.store import Store
from service.stack.embedded import Stack


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
        # the service ends the stream (a raw XADD of an `end` is what a job might forge: the relay drops it)
        Store(redis.Redis.from_url(stack.redis_url or "", decode_responses=True)).transition(job_id, JobState.CANCELLED)
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
