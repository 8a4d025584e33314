"""``after``: refused at submit when it names what cannot be waited for; the scheduler holds a dependent job in the
queue with its reason, starts it once all its dependencies succeeded, fails it naming the one that failed, and
keeps all of it in Redis so a restarted scheduler decides the same (API + real Redis, the scheduler's own
functions on a static cluster: no training needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from api_schemas import keys
from api_schemas.jobs import Demand, JobState
from api_schemas.notify import MAX_AFTER
from service.api.views import queue_view
from service.core.settings import Settings
from service.core.store import Store
from service.launch.ray_cluster import StaticCluster
from service.rules import policy
from service.rules.policy import Node, QueuedJob
from service.scheduler.tick import Scheduler
from tests.service.conftest import STATIC_NODES, Api, tiny

UNKNOWN = "0000000000a-abcdef"


def submit(c: httpx.Client, after: list[str] | None = None, sweep: bool = False, **kw: Any) -> httpx.Response:
    if sweep:
        body = {"base": tiny(), "search_space": {"training.seed": {"grid": [0, 1]}}, **kw}
    else:
        body = {"spec": tiny(), **kw}
    if after is not None:
        body["after"] = after
    return c.post("/v1/sweeps" if sweep else "/v1/experiments", json=body)


def refused(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 422, r.text
    err = r.json()["errors"][0]
    assert err["field"].startswith("after"), r.text
    assert all(w in err["message"] for w in words), r.text


def scheduler(store: Store) -> Scheduler:
    """A scheduler on the static 2-node cluster; only its reading and deciding are used (no Ray)."""
    return Scheduler(store, Settings(redis_url="", cluster_nodes=STATIC_NODES), StaticCluster(STATIC_NODES),
                     launcher=None)  # type: ignore[arg-type]


def test_after_is_checked_at_submit(api_only: Api) -> None:
    api_only.add_user("alice")
    api_only.add_user("bob")
    store = Store.from_url(api_only.stack.redis_url or "")
    with api_only.client("alice") as alice, api_only.client("bob") as bob, api_only.client() as admin:
        mine = submit(alice).json()["id"]
        theirs = submit(bob).json()["id"]
        refused(submit(alice, [UNKNOWN]), "no job", UNKNOWN)
        refused(submit(alice, [mine, theirs]), theirs, "another user's")
        refused(submit(alice, [theirs], sweep=True), "another user's")
        assert submit(admin, [theirs]).status_code == 201  # admins may wait for anyone's job
        assert submit(alice, ["../etc"]).status_code == 422  # not a job id at all
        r = submit(alice, [mine] * (MAX_AFTER + 1))
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "after", r.text
        r = submit(alice, [mine, mine])
        assert r.status_code == 201 and r.json()["after"] == [mine], r.text  # repeats collapse
        child = r.json()["id"]
        assert alice.get(f"/v1/experiments/{child}").json()["after"] == [mine]
        # a cycle cannot be made through the API (a new job's id does not exist yet); one planted in Redis is found
        store.r.hset(keys.job(mine), "after", json.dumps([child]))
        refused(submit(alice, [mine]), "cycle", f"{mine} -> {child} -> {mine}")
        store.r.hset(keys.job(mine), "after", json.dumps([mine]))
        refused(submit(alice, [child]), "cycle", f"{mine} -> {mine}")  # a job naming itself
        store.r.hdel(keys.job(mine), "after")
        gone = submit(alice).json()["id"]
        assert alice.post(f"/v1/experiments/{gone}/cancel").status_code == 202
        refused(submit(alice, [gone]), gone, "cancelled", "never succeed")
        assert submit(alice, [mine], sweep=True).status_code == 201


def test_a_dependent_job_waits_then_starts_or_fails_naming_the_failed_one(api_only: Api) -> None:
    api_only.add_user("alice")
    store = Store.from_url(api_only.stack.redis_url or "")
    with api_only.client("alice") as c:
        first, other = submit(c).json()["id"], submit(c).json()["id"]
        second = submit(c, [first, other]).json()["id"]
        doomed = submit(c, [other]).json()["id"]
        free = submit(c).json()["id"]
    sched = scheduler(store)
    decision, nodes, active = sched.decide(1.0)
    started = [j.id for j, _ in decision.starts]
    assert first in started and other in started and free in started and second not in started
    reasons = dict(decision.order)
    assert reasons[second] == f"waiting for {first} (queued), {other} (queued)"
    sched.publish(decision, nodes, active, 1.0)  # what the queue view and the job's view show
    user = store.user("alice")
    assert user is not None
    shown = {e.id: e.pending_reason for e in queue_view(store, user).items}
    assert shown[second] == reasons[second] and store.view(second).pending_reason == reasons[second]

    for job in (first, other):
        assert store.transition(job, JobState.STARTING, expect=[JobState.QUEUED], attempts="1")
        assert store.transition(job, JobState.RUNNING)
    assert store.transition(first, JobState.SUCCEEDED)
    restarted = scheduler(store)  # nothing in memory: the next scheduler reads it all from Redis
    decision = restarted.decide(2.0)[0]
    assert dict(decision.order)[second] == f"waiting for {other} (running)"
    assert second not in [j.id for j, _ in decision.starts]
    assert store.transition(other, JobState.FAILED, reason="boom", failure_reason="boom")
    decision = restarted.decide(3.0)[0]
    view = store.view(doomed)
    assert view.state == JobState.FAILED and other in (view.failure_reason or "")
    assert "ended failed" in (view.failure_reason or "") and doomed not in dict(decision.order)
    assert store.view(second).state == JobState.FAILED  # it needed `other` too


def test_a_dependency_that_succeeds_lets_the_job_start() -> None:
    """Pure policy: once its dependency succeeded, nothing is left to block it; while blocked it keeps its place
    in the order, reserves nothing and does not hold up its owner's or anyone's other jobs."""
    cpu = Demand(workers=1, cpus_per_worker=1, gpus_per_worker=0)
    nodes = [Node("n", cpus=1, gpus=0)]
    waiting = QueuedJob("j1", "alice", 5, 0.0, cpu, after=("j0",))
    later = QueuedJob("j2", "alice", 0, 1.0, cpu)
    d = policy.decide([waiting, later], [], nodes, {}, {}, blocked={"j1": "waiting for j0 (running)"})
    assert [j.id for j, _ in d.starts] == ["j2"] and d.order == [("j1", "waiting for j0 (running)")]
    d = policy.decide([waiting, later], [], nodes, {}, {}, blocked={})
    assert [j.id for j, _ in d.starts] == ["j1"]  # priority 5 first once nothing blocks it


def test_tlab_submit_after_and_notify(api_only: Api, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(tiny()))
    with api_only.client() as c:
        first = submit(c).json()["id"]
    tlab = [str(Path(sys.executable).parent / "tlab"), "submit", str(spec), "--url", api_only.url,
            "--token", api_only.tokens["admin"]]
    out = subprocess.run([*tlab, "--after", first, "--notify", "https://hooks.example.org/x"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    with api_only.client() as c:
        view = c.get(f"/v1/experiments/{out.stdout.split()[0]}").json()
    assert view["after"] == [first] and view["notify"]["webhook"] == "https://hooks.example.org/x"
    out = subprocess.run([*tlab, "--after", UNKNOWN], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "after" in out.stderr and UNKNOWN in out.stderr, out.stderr
