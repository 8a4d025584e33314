"""Part 3, scheduling decision time: ``policy.decide`` alone, and ``Scheduler.decide`` end to end (reading
the queue, users and usage from a real Redis), with 1,000 queued jobs from 10 users.
Floor: <= 10 ms per decision."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from api_schemas.jobs import Demand, ExperimentSubmit, JobState, Quotas, UserCreate
from benchmarks.common import print_table, verdict
from benchmarks.service.common import FLOORS, TINY, Sizes, ms, pct
from service.core.settings import Settings
from service.core.store import Store
from service.launch.ray_cluster import StaticCluster
from service.rules import policy
from service.scheduler.tick import Scheduler
from service.stack.embedded import Stack

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
    queued_spec, active_spec = synthetic_load(sizes)
    owners = sorted({q["owner"] for q in queued_spec} | {a["owner"] for a in active_spec})
    usage = {u: 10.0 * i for i, u in enumerate(owners)}
    result: dict[str, Any] = {
        "queued": sizes.queued, "users": len(owners), "active": len(active_spec), "nodes": DECIDE_NODES,
        "repeats": sizes.decide_repeats, "pure": _decide_pure(sizes, queued_spec, active_spec, owners, usage),
        "scheduler": _decide_scheduler(sizes, home, queued_spec, active_spec, owners, usage),
    }
    floor = FLOORS["decision_ms"] / 1000
    result["meets_floor"] = result["pure"]["p99_s"] <= floor and result["scheduler"]["p99_s"] <= floor
    _print_decide(result, sizes)
    return result


def _decide_pure(sizes: Sizes, queued_spec: list[dict[str, Any]], active_spec: list[dict[str, Any]],
                 owners: list[str], usage: dict[str, float]) -> dict[str, Any]:
    """``policy.decide`` on in-memory inputs."""
    now = time.time()
    nodes = StaticCluster(DECIDE_NODES).nodes()
    queued = [policy.QueuedJob(f"q{i:05d}", q["owner"], q["priority"], now - sizes.queued + i,
                               Demand(workers=q["workers"], cpus_per_worker=1, gpus_per_worker=q["gpus"]))
              for i, q in enumerate(queued_spec)]
    active = [policy.ActiveJob(f"a{i:03d}", a["owner"], Demand(workers=1, cpus_per_worker=1, gpus_per_worker=a["gpus"]),
                               tuple(a["placement"])) for i, a in enumerate(active_spec)]
    quotas = {u: Quotas() for u in owners}
    policy.decide(queued, active, nodes, usage, quotas)  # warm-up
    pure, decision = _time(lambda: policy.decide(queued, active, nodes, usage, quotas), sizes.decide_repeats)
    return {"median_s": statistics.median(pure), "p99_s": pct(pure, 0.99), "max_s": max(pure),
            "starts": len(decision.starts), "waiting": len(decision.order)}


def _fill(store: Store, queued_spec: list[dict[str, Any]], active_spec: list[dict[str, Any]], owners: list[str],
          usage: dict[str, float]) -> float:
    """Submit the queued and active jobs to Redis, move the active ones to starting, charge usage; seconds taken."""
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
    return fill_s


def _decide_scheduler(sizes: Sizes, home: Path, queued_spec: list[dict[str, Any]], active_spec: list[dict[str, Any]],
                      owners: list[str], usage: dict[str, float]) -> dict[str, Any]:
    """``Scheduler.decide`` end to end over a real Redis."""
    stack = Stack(home)
    home.mkdir(parents=True, exist_ok=True)
    try:
        stack.start_redis()
        store = Store.from_url(stack.redis_url or "")
        fill_s = _fill(store, queued_spec, active_spec, owners, usage)
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
    return {
        "fill_s": fill_s, "queued_in_redis": len(queued_spec), "active_in_redis": len(active_spec),
        "cold_s": cold[0], "median_s": statistics.median(warm), "p99_s": pct(warm, 0.99), "max_s": max(warm),
        "redis_reads_median_s": statistics.median(reads),
        "uncached_median_s": statistics.median(nocache), "uncached_max_s": max(nocache),
        "publish_median_s": statistics.median(pub),
        "starts": len(d.starts), "waiting": len(d.order), "same_as_cold": [j.id for j, _ in d_cold.starts]
        == [j.id for j, _ in d.starts],
    }


def _print_decide(result: dict[str, Any], sizes: Sizes) -> None:
    s, p = result["scheduler"], result["pure"]
    print(f"\n3. scheduling decision: {sizes.queued} queued jobs of {result['users']} users, {result['active']} "
          f"active, {len(DECIDE_NODES)} nodes x (8 CPUs, 2 GPUs); {sizes.decide_repeats} repeats "
          f"(floor: <= {FLOORS['decision_ms']:g} ms per decision)")
    print_table(["what", "median ms", "p99 ms", "max ms", "starts", "waiting"],
                [["policy.decide (pure)", ms(p["median_s"]), ms(p["p99_s"]), ms(p["max_s"]), p["starts"],
                  p["waiting"]],
                 ["Scheduler.decide (Redis, warm cache)", ms(s["median_s"]), ms(s["p99_s"]), ms(s["max_s"]),
                  s["starts"], s["waiting"]],
                 ["  its Redis reads alone", ms(s["redis_reads_median_s"]), "", "", "", ""],
                 ["Scheduler.decide, first call (cold)", ms(s["cold_s"]), "", "", "", ""],
                 ["Scheduler.decide, queued-job cache dropped", ms(s["uncached_median_s"]), "",
                  ms(s["uncached_max_s"]), "", ""],
                 ["Scheduler.publish (queue view + cluster)", ms(s["publish_median_s"]), "", "", "", ""]])
    print(f"   floor (pure and warm Scheduler.decide p99): {verdict(result['meets_floor'])}")
