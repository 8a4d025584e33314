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
   reports running) and worker start (driver running -> first metric event), and the driver's start-up
   timeline (process spawn, imports, torch, process group, data, model, first checkpoint: workers/train/startup.py).

The load generators run on the same machine (and cores) as the API and Redis: on a 2-core box the
numbers are for the whole system, client included. CPU seconds per process are reported per part.
Each part lives in its own module under ``benchmarks/service/``; this one runs them and writes the JSON.

    python -m benchmarks.service_bench [--quick] [--parts submit sse decide e2e]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import verdict, wait_for_quiet, write_result
from benchmarks.service.common import FLOORS, Sizes, api_only_stack
from benchmarks.service.decisions import bench_decide
from benchmarks.service.sse import bench_sse
from benchmarks.service.startup import bench_e2e
from benchmarks.service.submissions import bench_submissions

PARTS = ("submit", "sse", "decide", "e2e")


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
