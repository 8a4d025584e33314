"""Time limits: a limit over the cluster's maximum or the user's quota is a 422 naming the field;
a running job that reaches its limit is stopped, ends failed with a reason naming the limit and its last
epoch, and keeps its last checkpoint as an artifact."""

from __future__ import annotations

import json
import time

import pytest
import redis

from api_schemas import keys
from service.cli.client import Client
from service.core.settings import Settings
from service.rules.limits import time_limit
from service.stack.embedded import Stack
from tests.service.api.test_admission import refused
from tests.service.conftest import Api, tiny
from tests.service.test_failure_reasons import wait_ended


def test_a_limit_over_the_cap_is_refused_naming_the_field(api_only: Api) -> None:
    api_only.add_user("ann", max_time_limit_s=600)
    with api_only.client("ann") as c:
        r = c.post("/v1/experiments", json={"spec": tiny(resources={"time_limit_s": 601})})
        refused(r, "spec.resources.time_limit_s", "601", "max_time_limit_s", "600")
        assert c.post("/v1/experiments", json={"spec": tiny(resources={"time_limit_s": 600})}).status_code == 201
        r = c.post("/v1/experiments", json={"spec": tiny(resources={"time_limit_s": 0})})
        assert r.status_code == 422 and "time_limit_s" in r.text  # > 0: the contract itself
        sweep = {"base": tiny(), "search_space": {"optimizer.lr": {"choice": [0.1, 0.01]}}}
        refused(c.post("/v1/sweeps", json={**sweep, "time_limit_s": 900}), "time_limit_s", "max_time_limit_s")
        base = tiny(resources={"time_limit_s": 900})
        refused(c.post("/v1/sweeps", json={**sweep, "base": base}), "base.resources.time_limit_s")
    with api_only.client() as c:  # an admin is bound only by the cluster's maximum (a week by default)
        assert c.post("/v1/experiments", json={"spec": tiny(resources={"time_limit_s": 7200})}).status_code == 201
        r = c.post("/v1/experiments", json={"spec": tiny(resources={"time_limit_s": 8 * 86400})})
        refused(r, "spec.resources.time_limit_s", "TLAB_MAX_TIME_LIMIT_S")


def test_the_limit_is_the_specs_else_the_cluster_default() -> None:
    settings = Settings(TLAB_DEFAULT_TIME_LIMIT_S=50)
    assert time_limit(settings, {"spec": json.dumps(tiny(resources={"time_limit_s": 20}))}) == 20
    assert time_limit(settings, {"spec": json.dumps(tiny())}) == 50
    sweep = {"base": tiny(resources={"time_limit_s": 20}), "time_limit_s": 70}
    assert time_limit(settings, {"kind": "sweep", "sweep": json.dumps(sweep)}) == 70  # the trials' is not the sweep's
    assert time_limit(settings, {"kind": "sweep", "sweep": json.dumps({"base": tiny()})}) == 50


def wait_epochs(c: Client, job: str, epochs: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while (c.get(job)["progress"].get("epoch") or 0) < epochs:
        assert time.monotonic() < deadline, f"{job} reported no {epochs} epochs in {timeout} s: {c.get(job)}"
        time.sleep(0.3)


@pytest.mark.slow
def test_a_job_at_its_time_limit_ends_failed_and_keeps_its_checkpoint(stack: Stack) -> None:
    # many short epochs: it cannot finish; its limit is lowered (in Redis, where the scheduler reads it each
    # tick) once it has reported epochs, so the test does not hang on how long Ray Train takes to start here
    spec = tiny(training={"epochs": 1000, "batch_size": 64, "max_steps_per_epoch": 1},
                resources={"time_limit_s": 3600})
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(spec, name="limited")["id"]
        wait_epochs(c, job, 2)
        stored = json.loads(r.hget(keys.job(job), "spec"))
        assert stored["resources"]["time_limit_s"] == 3600
        stored["resources"]["time_limit_s"] = 1
        r.hset(keys.job(job), "spec", json.dumps(stored))
        view = wait_ended(c, job, timeout=600)
        assert view["state"] == "failed", view
        reason = view["failure_reason"]
        assert reason.startswith("time limit of 1 s reached at epoch "), reason
        epoch = int(reason.split("at epoch ")[1].split(":")[0])
        assert 2 <= epoch < 1000
        assert float(r.hget(keys.job(job), "time_limited")) == 1
        assert view["finished_at"] - view["started_at"] >= 1  # counted from started_at
        names = {a["name"]: a for a in c.json("GET", f"/v1/experiments/{job}/artifacts")["items"]}
        assert {"checkpoint.pt", "model.safetensors", "metrics.csv", "summary.json"} <= set(names), names
        summary = json.loads(c.request("GET", f"/v1/experiments/{job}/artifacts/summary.json").content)
        assert summary["complete"] is False and summary["epochs"] >= 2
        rows = c.request("GET", f"/v1/experiments/{job}/artifacts/metrics.csv").text.splitlines()
        assert len(rows) == 1 + summary["epochs"]  # the header, then one row per epoch in the checkpoint
        logs = c.request("GET", f"/v1/experiments/{job}/logs").text
        assert "artifacts: checkpoint.pt, model.safetensors" in logs  # the driver exported them on SIGTERM


def test_a_sweeps_own_limit_stops_it_and_each_trials_limit_goes_to_tune(redis_server: str) -> None:
    """The two limits of a sweep on real objects: the scheduler (on real Redis, ticked at chosen times; Ray's Jobs
    API behind its Launcher seam) holds the whole sweep to ``time_limit_s``, counted while it runs, across a
    preemption; each trial's ``base.resources.time_limit_s`` becomes Tune's stop criterion. A unit test of billing
    time, as test_fair_share.py is; on real Ray the same paths are asserted once each: the scheduler's stop at a
    limit (kind-blind, ``Scheduler.check_limit``) by the experiment above, running time across a preemption by
    test_preemption.py, the trials' limit by ``test_artifacts.py`` (a sweep whose trials stop at 3 s)."""
    from api_schemas.jobs import JobState
    from api_schemas.sweeps import SweepSubmit
    from service.core.store import Store
    from service.launch.ray_cluster import RayJobs, StaticCluster
    from service.scheduler import preempt as preempting
    from service.scheduler.tick import Scheduler
    from tests.service.scheduler.test_fair_share import NODES, Jobs, tick
    from workers.sweep import trial_stop

    raw = {"base": tiny(resources={"time_limit_s": 5}), "time_limit_s": 30,
           "search_space": {"optimizer.lr": {"grid": [0.01, 0.1]}}}
    body = SweepSubmit.model_validate(raw)
    assert trial_stop(body) == {"time_total_s": 5}  # Tune's stop: each trial's own running time (time_total_s)
    assert trial_stop(SweepSubmit.model_validate({**raw, "base": tiny()})) is None  # no trial limit: none
    store, ray = Store.from_url(redis_server), Jobs()
    sched = Scheduler(store, Settings(redis_url=redis_server, cluster_nodes=NODES), StaticCluster(NODES), ray)
    sweep = store.submit("ann", body, now=999.0)[0]
    tick(sched, 1000.0)
    tick(sched, 1001.0)  # running from 1001
    tick(sched, 1020.0)  # past each trial's 5 s, within the sweep's 30 s: the trials' limit is Tune's, not ours
    assert store.raw(sweep)["state"] == "running" and ray.states[RayJobs.submission_id(sweep, 1)] == "RUNNING"
    # preempted at 1021 (20 s run), queued 100 s, running again from 1121: 20 + 9 s at 1130 is within the limit
    ray.stop(RayJobs.submission_id(sweep, 1))
    assert preempting.requeue(store, store.raw(sweep), now=1021.0)
    for now in (1120.0, 1121.0, 1130.0):
        tick(sched, now)
    assert store.raw(sweep)["state"] == "running", store.raw(sweep)
    tick(sched, 1131.0)  # 20 + 10 s: the scheduler stops the sweep's Ray job (its driver exports the best trial)
    assert ray.states[RayJobs.submission_id(sweep, 2)] == "STOPPED"
    tick(sched, 1132.0)
    view = store.view(sweep)
    assert view.state == JobState.FAILED and view.failure_reason
    assert view.failure_reason.startswith("time limit of 30 s reached before its first epoch ended"), view
