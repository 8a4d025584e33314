"""Part 1, submissions: an API-only stack (real Redis, the API process, no scheduler, a fixed simulated
cluster) and one ``httpx.AsyncClient`` driving C concurrent clients that POST ``/v1/experiments`` for a
fixed time; throughput and p50/p99 latency per C. Floor: >= 300/s with p99 <= 50 ms."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import httpx

from benchmarks.common import print_table, verdict
from benchmarks.service.common import FLOORS, LOADGEN_NOTE, TINY, CpuMeter, Sizes, ms, pct
from service.stack.embedded import Stack


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
