"""Preemption: the max_unpreemptible quota at submit; the requeue on a real Redis (age kept, counted,
not a failure); and on the real 2-CPU stack, a priority-5 job preempting a priority-0 one that then resumes
from its checkpoint with every epoch exactly once, and a non-preemptible job left alone."""

from __future__ import annotations

import json
import time

import pytest
import redis

from api_schemas import keys
from api_schemas.jobs import ExperimentSubmit, JobState
from service.cli.client import Client
from service.core.settings import Settings
from service.core.store import Store
from service.rules.policy import CPU_WEIGHT
from service.scheduler import preempt as preempting
from service.stack.embedded import Stack
from tests.service.api.test_admission import refused
from tests.service.conftest import Api, tiny, wait_ray_idle
from tests.service.scheduler.test_time_limits import wait_epochs
from tests.service.test_failure_reasons import wait_ended

PINNED = tiny(resources={"preemptible": False})


def test_non_preemptible_jobs_are_a_quota(api_only: Api) -> None:
    api_only.add_user("ann")  # max_unpreemptible: 1 by default
    api_only.add_user("bob", max_unpreemptible=0)
    with api_only.client("ann") as c:
        first = c.post("/v1/experiments", json={"spec": PINNED})
        assert first.status_code == 201 and first.json()["preemptions"] == 0
        refused(c.post("/v1/experiments", json={"spec": PINNED}), "spec.resources.preemptible", first.json()["id"],
                "max_unpreemptible quota is 1")
        assert c.post("/v1/experiments", json={"spec": tiny()}).status_code == 201  # preemptible: no limit
        sweep = {"base": PINNED, "search_space": {"optimizer.lr": {"choice": [0.1, 0.01]}}}
        refused(c.post("/v1/sweeps", json=sweep), "base.resources.preemptible")
        assert c.post(f"/v1/experiments/{first.json()['id']}/cancel").status_code in (200, 202)
        assert c.post("/v1/experiments", json={"spec": PINNED}).status_code == 201  # the cancelled one is gone
    with api_only.client("bob") as c:
        refused(c.post("/v1/experiments", json={"spec": PINNED}), "spec.resources.preemptible", "quota is 0")
    with api_only.client() as c:  # admins are not bound
        assert all(c.post("/v1/experiments", json={"spec": PINNED}).status_code == 201 for _ in range(2))


def test_a_preempted_job_is_queued_again_with_its_age_and_counted(redis_server: str) -> None:
    store = Store.from_url(redis_server)
    job, *_ = store.submit("alice", ExperimentSubmit.model_validate({"spec": tiny()}), now=100.0)
    assert store.transition(job, JobState.STARTING, expect=[JobState.QUEUED], attempts="1", now=101.0)
    assert store.transition(job, JobState.RUNNING, started_at="102.0", now=102.0)
    store.r.hset(keys.job(job), mapping={preempting.PREEMPTED_BY: "urgent", preempting.PREEMPTED_PRIORITY: "5"})
    assert preempting.requeue(store, store.raw(job), now=110.0)
    data = store.raw(job)
    assert store.r.zscore(keys.queue(), job) == 100.0  # its original enqueue time: ahead of later jobs
    assert (data["preemptions"], data["ran_s"], data["resume_free"], data["preempted_by"]) == ("1", "8.0", "1", "")
    assert preempting.failed_attempts(data) == 0  # a preemption is not a failed attempt
    view = store.view(job)
    assert view.state == JobState.QUEUED and view.preemptions == 1
    assert (view.last_preemption or "").startswith("preempted by urgent (priority 5) at ")
    status = [json.loads(f["data"]) for _, f in store.events(job) if f["kind"] == "status"]
    assert status[-1]["state"] == "queued" and status[-1]["reason"].startswith("preempted by urgent (priority 5)")
    assert not preempting.requeue(store, store.raw(job), now=111.0)  # queued already: nothing moves


def events(r: redis.Redis, job: str, kind: str) -> list[dict]:
    """The job's records of one kind (``epoch``, ``start``, ``log``, ``status``), oldest first."""
    records = [json.loads(f["data"]) for _, f in r.xrange(keys.events(job))]
    return [d for d in records if d.get("kind") == kind]


def wait_reason(c: Client, job: str, needle: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while needle not in (reason := c.get(job).get("pending_reason") or ""):
        assert time.monotonic() < deadline, f"{job} never waited with {needle!r}; its reason: {reason!r}"
        time.sleep(0.2)
    return reason


# A holds both CPUs of the 2-CPU head and runs long enough to be caught mid-run; B needs both CPUs too
LONG = {"epochs": 30, "batch_size": 32}  # preempted near epoch 9 (2 cores, alone): 20 to spare
BOTH_CPUS = {"cpus_per_worker": 2}


def held_seconds(r: redis.Redis, job: str) -> tuple[float, float]:
    """When the job first started, and how long it held its gang in all: from each move to ``starting`` to the
    move that ended that attempt (back to ``queued``, or an end state), by its status events' times."""
    moves = [(e["state"], e["at"]) for e in events(r, job, "status") if "at" in e]
    starts = [at for state, at in moves if state == "starting"]
    ends = [at for (state, at), (before, _) in zip(moves[1:], moves, strict=False)
            if state in ("queued", "succeeded", "failed", "cancelled") and before in ("starting", "running")]
    return starts[0], sum(end - start for start, end in zip(starts, ends, strict=True))


def check_fair_share(r: redis.Redis, owner: str, job: str, gang_weight: float) -> None:
    """The owner's decayed usage is one start charge and the time the job held its gang, to within a few ticks:
    no second start charge for its restart after the preemption, nor the time it waited in the queue."""
    usage = json.loads(r.hget(keys.usage(), owner) or "{}")
    first, held = held_seconds(r, job)
    settings = Settings()
    decay = 0.5 ** ((usage["at"] - first) / settings.half_life_s)  # what decayed since it first started
    low, high = (gang_weight * (settings.start_charge_s + held + d) for d in (-3, 3))
    assert low * decay <= usage["value"] <= high, (usage, first, held, decay)


@pytest.mark.slow
def test_a_higher_priority_job_preempts_and_the_victim_resumes_every_epoch_once(stack: Stack) -> None:
    wait_ray_idle(stack)
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    ann = Api(stack).add_user("ann")  # A's owner: whose fair-share usage is checked
    with Client(stack.url, stack.admin_token) as c, Client(stack.url, ann) as c_ann:
        a = c_ann.submit(tiny(training=LONG, resources=BOTH_CPUS), name="long")["id"]
        wait_epochs(c, a, 2)
        b = c.submit(tiny(resources=BOTH_CPUS), name="urgent", priority=5)["id"]
        view_b = wait_ended(c, b, timeout=300)
        view_a = wait_ended(c, a, timeout=300)
    assert view_b["state"] == "succeeded", view_b
    assert view_a["state"] == "succeeded", view_a
    assert view_a["preemptions"] == 1 and view_a["attempts"] == 2, view_a
    theirs = "preempted by another user's job (priority 5)"  # B is the admin's: ann is not told its id
    assert view_a["last_preemption"].startswith(f"{theirs} at ")
    # every epoch exactly once across the preemption, and the second run started from a checkpoint
    assert [m["epoch"] for m in events(r, a, "epoch")] == list(range(LONG["epochs"]))
    starts = events(r, a, "start")
    assert len(starts) == 2 and starts[1]["resumed_from_epoch"] >= 2, starts
    logs = [e["message"] for e in events(r, a, "log")]
    assert any(m.startswith(f"{theirs}: checkpointing") for m in logs), logs
    moves = [(e["state"], e.get("reason", "")) for e in events(r, a, "status") if "at" in e]
    requeued = [reason for state, reason in moves if state == "queued"][1:]  # the first is the submit's
    assert len(requeued) == 1 and requeued[0].startswith(theirs), moves
    requeued_at = next(e["at"] for e in events(r, a, "status") if e.get("reason", "").startswith("preempted"))
    assert view_b["started_at"] >= requeued_at  # B ran only once A had stopped: never both on 2 CPUs
    check_fair_share(r, "ann", a, 2 * CPU_WEIGHT)


@pytest.mark.slow
def test_a_non_preemptible_job_is_left_running_and_the_other_waits_saying_why(stack: Stack) -> None:
    wait_ray_idle(stack)
    spec = tiny(training={"epochs": 100_000, "max_steps_per_epoch": 1}, resources={**BOTH_CPUS, "preemptible": False})
    with Client(stack.url, stack.admin_token) as c:
        a = c.submit(spec, name="pinned")["id"]
        wait_epochs(c, a, 2)
        b = c.submit(tiny(resources=BOTH_CPUS), name="urgent", priority=5)["id"]
        reason = wait_reason(c, b, "cannot preempt")
        assert reason.startswith("no room") and f"cannot preempt {a}: resources.preemptible=false" in reason
        view_a = c.get(a)
        assert view_a["state"] == "running" and view_a["preemptions"] == 0
        c.cancel(b)
        c.cancel(a)
        assert wait_ended(c, a, timeout=120)["state"] == "cancelled"
