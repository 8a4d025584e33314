"""End to end on a real Ray head, real Redis, the real API and scheduler processes, real HTTP."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import redis

from api_schemas import keys
from api_schemas.jobs import JobState
from service.cli.client import Client, Event
from service.core.store import Store
from service.stack.embedded import Stack
from tests.service.conftest import ray_holders, ray_jobs, ray_rest, tiny, wait_for

pytestmark = pytest.mark.slow


def wait_state(c: Client, job: str, states: set[str], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = c.get(job)
        if view["state"] in states:
            return view
        time.sleep(0.2)
    raise AssertionError(f"{job} never reached {states}; last {view['state']} {view.get('pending_reason')}")


def stream_ids(redis_url: str, job: str) -> list[str]:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    return [eid for eid, _ in r.xrange(keys.events(job))]


def ray_jobs_of(stack: Stack, job: str) -> list[dict]:
    """The Ray cluster's own record of a job's Ray jobs (its Jobs REST API, with the cluster's token)."""
    return [{"id": j["submission_id"], "status": j["status"]} for j in ray_jobs(stack)
            if (j.get("metadata") or {}).get("tlab_job") == job]


def epochs_in(events: list[Event]) -> list[int]:
    return [e.data["epoch"] for e in events if e.kind == "metric"]


def test_submit_run_follow_and_resume_exactly_once(stack: Stack) -> None:
    with Client(stack.url, stack.admin_token) as c:
        spec = tiny(training={"epochs": 4}, teleport={"enabled": True, "epochs": [1], "batches": 2, "steps": 2,
                                                                  "budget": None})
        job = c.submit(spec, name="e2e")["id"]
        first: list[Event] = []
        for event in c.events(job):  # follow from the start; drop the connection after the first epoch
            first.append(event)
            if event.kind == "metric":
                break
        rest = list(c.events(job, last_id=first[-1].id))  # resume: exactly the rest
        events = first + rest
        assert [e.id for e in events] == stream_ids(stack.redis_url or "", job)  # nothing lost, nothing twice
        states = [e.data["state"] for e in events if e.kind == "status" and "at" in e.data]
        assert states == ["queued", "starting", "running", "succeeded"]
        assert epochs_in(events) == [0, 1, 2, 3] and events[-1].kind == "end"
        assert any(e.kind == "teleport" for e in events)
        view = c.get(job)
        assert view["state"] == "succeeded" and view["summary"]["epochs"] == 4 and view["attempts"] == 1
        # the head advertises 2 GPUs; a job that asked for none was shown none (Ray 2.60 would leave it unset)
        assert (view["summary"]["device"], view["summary"]["cuda_visible_devices"]) == ("cpu", "")
        assert view["progress"]["epoch"] == 4 and view["started_at"] <= view["finished_at"]
        m = c.json("GET", f"/v1/experiments/{job}/metrics", params={"max_points": 2})
        assert m["total_points"] == 4 and [p["epoch"] for p in m["points"]] == [0, 3] and m["teleports"]
        csv = c.request("GET", f"/v1/experiments/{job}/metrics", params={"format": "csv"}).text.splitlines()
        assert csv[0].startswith("epoch,") and len(csv) == 5
        assert c.plot([job])[:8] == b"\x89PNG\r\n\x1a\n"
        assert c.request("GET", f"/v1/experiments/{job}/logs").text.startswith("[tlab] driver of job")  # kept


def test_a_gang_of_two_half_gpus_shares_one_card_on_gloo(stack: Stack) -> None:
    """Two ranks at 0.5 GPU on the session head's 2 advertised H100s (tests/conftest.py): Ray packs both onto one
    card (each told the same CUDA_VISIBLE_DEVICES, where NCCL refused: "Duplicate GPU detected"), the process
    group is gloo, every epoch is reported once, and the cluster view shows the job's share while it runs."""
    from tests.service.conftest import wait_ray_idle

    wait_ray_idle(stack)  # the gang needs both CPUs of the head
    spec = tiny(training={"epochs": 3, "device": "cpu",  # the share held, the CPU training (no card is there)
                          "grad_accumulation": 2, "grad_clip_norm": 0.5},  # the LM recipe's step, over the gang
                optimizer={"name": "adamw", "lr": 0.01, "schedule": "cosine", "lr_warmup_steps": 2},
                resources={"workers": 2, "gpus_per_worker": 0.5, "gpu_type": "H100"})
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(spec)["id"]
        shares, deadline = [], time.monotonic() + 120
        while not shares and time.monotonic() < deadline:
            cluster = c.json("GET", "/v1/cluster")
            shares = [(s["workers"], s["gpus"], n["gpu_type"]) for n in cluster["nodes"] for s in n["jobs"]
                      if s["job"] == job]
            time.sleep(0.1)
        assert shares == [(2, 1.0, "H100")], cluster  # both ranks on the one node: 2 x 0.5 of its 2 GPUs
        events = list(c.events(job))
        assert epochs_in(events) == [0, 1, 2] and c.get(job)["state"] == "succeeded", c.get(job)
        metrics = [e.data for e in events if e.kind == "metric"]
        lrs = [m["lr"] for m in metrics]
        assert lrs == sorted(lrs, reverse=True) and lrs[-1] == 0.0  # the cosine's end (final_lr_ratio 0)
        assert all(m["grad_norm"] > 0 and 0 <= m["clipped"] <= 1 for m in metrics)
        logs = {rank: c.logs(job, rank=rank) for rank in ("0", "1")}
        joined = {rank: re.search(r"rank \d of 2 joined on (\w+) \(cpu; resources.gpus_per_worker=0.5, "
                                  r"CUDA_VISIBLE_DEVICES='(\d)'\)", text) for rank, text in logs.items()}
        assert all(joined.values()), logs
        assert {m.group(1) for m in joined.values() if m} == {"gloo"}
        assert len({m.group(2) for m in joined.values() if m}) == 1  # one physical card for both ranks
        assert c.get(job)["summary"]["cuda_visible_devices"] == joined["0"].group(2)  # type: ignore[union-attr]


def test_cancel_a_running_job_stops_its_ray_job(stack: Stack) -> None:
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(tiny(training={"epochs": 100_000}))["id"]
        for event in c.events(job):
            if event.kind == "metric":
                break
        assert c.cancel(job)["state"] in {"starting", "running"}  # asked; the scheduler stops it
        events = list(c.events(job))
        assert events[-1].kind == "end" and events[-1].data["state"] == "cancelled"
        view = c.get(job)
        assert view["state"] == "cancelled" and view["progress"]["epoch"] < 100_000
        assert ray_jobs_of(stack, job) == [{"id": view["ray_job_id"], "status": "STOPPED"}]


def test_a_diverging_job_fails_with_its_reason(stack: Stack) -> None:
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(tiny(optimizer={"lr": 1e12}, training={"epochs": 3}))["id"]
        view = wait_state(c, job, {"succeeded", "failed"})
        assert view["state"] == "failed" and "diverged" in view["failure_reason"].lower(), view["failure_reason"]


@pytest.mark.drill
def test_kill9_scheduler_and_api_mid_run_loses_and_doubles_nothing(stack: Stack) -> None:
    url = stack.redis_url or ""
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(tiny(training={"epochs": 6}))["id"]
        for event in c.events(job):
            if event.kind == "metric":
                break
        # a second job, caught by the kill between "starting" and its Ray submit
        orphan = c.submit(tiny(training={"epochs": 1}), name="orphan")["id"]
        stack.kill("scheduler", signal.SIGKILL)
        stack.kill("api", signal.SIGKILL)
        r = redis.Redis.from_url(url, decode_responses=True)
        store = Store(r)
        if store.raw(orphan)["state"] == "queued":  # make it what a scheduler killed mid-dispatch leaves
            assert store.transition(orphan, JobState.STARTING, ray_job_id=f"tlab-{orphan}-1", attempts="1",
                                    placement="[]")
        time.sleep(2.0)  # the job keeps running with the service down
        stack.start_service()
    with Client(stack.url, stack.admin_token) as c:
        events = list(c.events(job))
        assert events[-1].data["state"] == "succeeded"
        assert epochs_in(events) == list(range(6))
        assert wait_state(c, orphan, {"succeeded", "failed"})["state"] == "succeeded"
        for j in (job, orphan):
            assert c.get(j)["attempts"] == 1
            ray_jobs = ray_jobs_of(stack, j)
            assert len(ray_jobs) == 1 and ray_jobs[0]["status"] == "SUCCEEDED", ray_jobs  # started exactly once
        kinds = [json.loads(f["data"]).get("state") for _, f in r.xrange(keys.events(job)) if f["kind"] == "status"]
        assert kinds.count("succeeded") == 1


RESTART_EPOCHS = 30


@pytest.mark.drill
def test_tlab_up_restart_mid_run_resumes_from_checkpoint(tmp_path: Path) -> None:
    """Stop the whole embedded stack (Redis, Ray, API, scheduler) mid-run and start it again with the
    same TLAB_HOME: the job goes back to the queue, resumes from its last checkpoint, and every
    epoch is in its history exactly once."""
    home = tmp_path / "tlab"
    env = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}
    with Stack(home, num_cpus=2, tick_s=0.2, extra_env=env) as s1, Client(s1.url, s1.admin_token) as c:
        # 30 epochs: the first 3 seen, the other 27 must outlast the stop of the API and the scheduler before Ray's
        # (12 once finished in it, under a full test run's load: 1 attempt, not 2)
        job = c.submit(tiny(training={"epochs": RESTART_EPOCHS}))["id"]
        seen = 0
        for event in c.events(job):
            seen += event.kind == "metric"
            if seen == 3:
                break
    with Stack(home, num_cpus=2, tick_s=0.2, extra_env=env) as s2, Client(s2.url, s2.admin_token) as c:
        events = list(c.events(job))
        view = c.get(job)
        assert view["state"] == "succeeded" and view["attempts"] == 2, view
        assert epochs_in(events) == list(range(RESTART_EPOCHS))
        states = [e.data["state"] for e in events if e.kind == "status" and "at" in e.data]
        assert states.count("queued") == 2
        # why it went back: its Ray job gone with the cluster, or (when the stop reached Ray before the scheduler, as
        # a loaded machine may order it) its driver ended by the stop's signal, or (when the new scheduler's first
        # look at the new cluster comes first) the loss of the node it was placed on; each from its checkpoint
        requeue = [e.data.get("reason", "") for e in events if e.kind == "status" and e.data.get("state") == "queued"]
        assert (("its Ray job vanished" in requeue[1] or requeue[1].startswith("driver killed by"))
                and "; retrying from epoch" in requeue[1]) or (
            requeue[1].startswith("the loss of node ") and requeue[1].endswith("resume from its last checkpoint")
        ), requeue
        # it resumed: the second attempt did not redo the first three epochs
        assert view["summary"]["epochs"] == RESTART_EPOCHS
        # both attempts' logs outlive the first cluster: kept in storage, the last words of the second included
        first, second = c.logs(job, attempt=1), c.logs(job)
        assert first.startswith("[tlab] driver of job") and ", attempt 1: pid" in first
        assert ", attempt 2: pid" in second and "model.safetensors" in c.logs(job, tail=1)
        followed = list(c.follow_logs(job))
        assert followed[-1].kind == "end" and {e.id.split(":")[0] for e in followed[:-1]} == {"1", "2"}
        assert [line for e in followed[:-1] for line in e.data.split("\n")] == first.splitlines() + second.splitlines()


def test_queue_says_why_jobs_wait_quota_and_room(stack: Stack) -> None:
    from tests.service.conftest import Api

    api = Api(stack)
    alice_token = api.add_user("alice", max_running_jobs=1)
    with Client(stack.url, alice_token) as alice, Client(stack.url, stack.admin_token) as admin:
        long = alice.submit(tiny(training={"epochs": 100_000}))["id"]
        wait_state(alice, long, {"running"})
        second = alice.submit(tiny(training={"epochs": 1}))["id"]
        big = admin.submit(tiny(training={"epochs": 1}, resources={"workers": 2}))["id"]  # the head has 2 CPUs
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            queue = {q["id"]: q for q in admin.json("GET", "/v1/queue")["items"]}
            if {second, big} <= set(queue) and all("waiting for the scheduler" not in q["pending_reason"]
                                                   for q in queue.values()):
                break
            time.sleep(0.2)
        assert "max_running_jobs=1" in queue[second]["pending_reason"]
        assert queue[big]["pending_reason"].startswith("no room") and queue[big]["position"] == 1
        assert alice.get(second)["pending_reason"] == queue[second]["pending_reason"]
        cluster = admin.json("GET", "/v1/cluster")
        assert cluster["running_jobs"] == [long] and cluster["cpus_free"] == 1 and cluster["scheduler_alive"]
        alice.cancel(long)
        assert wait_state(admin, big, {"succeeded", "failed"})["state"] == "succeeded"
        assert "[tlab] rank-1 of job" in admin.logs(big, rank="1")  # each Ray Train worker's log is kept
        assert wait_state(alice, second, {"succeeded", "failed"})["state"] == "succeeded"
        assert alice.get(long)["state"] == "cancelled"


HOLD = ("import ray, time; ray.init(); pg = ray.util.placement_group([{'CPU': 1.5}]); ray.get(pg.ready()); "
        "print('held', flush=True); time.sleep(600)")


def outside_ray_job(stack: Stack, what: str, job: str = "") -> str:
    """Another Ray user's job on the same cluster, through Ray's Jobs REST API with the cluster's token: ``start``
    one that holds 1.5 CPUs in a placement group (its submission id), read its ``logs``, ``stop`` it."""
    with ray_rest(stack) as http:
        if what == "start":
            body = {"entrypoint": f'{sys.executable} -c "{HOLD}"', "entrypoint_num_cpus": 0}
            return http.post("/api/jobs/", json=body).raise_for_status().json()["submission_id"]
        if what == "logs":
            return http.get(f"/api/jobs/{job}/logs").raise_for_status().json()["logs"]
        http.post(f"/api/jobs/{job}/stop").raise_for_status()
        return ""


def test_cpus_held_by_other_ray_work_are_not_handed_out(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    """A shared cluster: another user's Ray job holds 1.5 of the head's 2 CPUs. Teleport Lab's ledger alone
    would start a 1-CPU job whose worker then waits inside Ray with no reason shown; the scheduler reads what
    Ray reports in use, keeps the job queued saying why, and starts it once the other job lets go."""
    from service.cli import main
    from tests.service.conftest import wait_ray_idle

    wait_ray_idle(stack)
    holder = outside_ray_job(stack, "start")
    try:
        deadline = time.monotonic() + 90
        while "held" not in outside_ray_job(stack, "logs", holder):
            assert time.monotonic() < deadline, outside_ray_job(stack, "logs", holder)
            time.sleep(1.0)
        deadline = time.monotonic() + 30  # as Ray's own APIs see it: the job, and its placement group of 1.5 CPUs
        while not (held := ray_holders(stack))["placement_groups"]:  # the State API may lag the job's own view
            assert time.monotonic() < deadline, held
            time.sleep(0.5)
        assert [j["id"] for j in held["ray_jobs"]] == [holder], held
        assert [g["bundles"] for g in held["placement_groups"]] == [[{"CPU": 1.5}]], held
        with Client(stack.url, stack.admin_token) as c:  # once the head's usage report (every ~5 s) shows the group
            wait_for(lambda: c.json("GET", "/v1/cluster")["cpus_outside"] == pytest.approx(1.5), 60,
                     f"the scheduler never saw the 1.5 CPUs held outside: {ray_holders(stack)}")
            job = c.submit(tiny(training={"epochs": 1}))["id"]
            deadline = time.monotonic() + 30
            while "Ray reports 1.5 CPUs" not in (reason := c.get(job)["pending_reason"] or ""):
                assert time.monotonic() < deadline, c.get(job)
                time.sleep(0.3)
            assert c.get(job)["state"] == "queued" and reason.startswith("no room"), reason
            cluster = c.json("GET", "/v1/cluster")
            assert cluster["cpus_free"] == pytest.approx(0.5) and not cluster["running_jobs"], cluster
            assert cluster["cpus_outside"] == pytest.approx(1.5) and cluster["gpus_outside"] == 0, cluster
            assert main(["--url", stack.url, "--token", stack.admin_token, "cluster"]) == 0
            assert "Ray reports 1.5 CPUs, 0 GPUs in use beyond" in capsys.readouterr().out
            outside_ray_job(stack, "stop", holder)
            assert wait_state(c, job, {"succeeded", "failed"})["state"] == "succeeded"
    finally:
        outside_ray_job(stack, "stop", holder)


@pytest.mark.parametrize("stack_env", [{"TLAB_WEBHOOK_ALLOW": "127.0.0.1"}])  # the receivers are on loopback
def test_a_job_after_another_starts_once_it_succeeded_and_webhooks_hold_up_nothing(stack: Stack) -> None:
    """``after`` and ``notify`` on the real stack: B waits for A with A as its reason and starts only once A
    succeeded; A's webhook receiver hangs, yet B starts, ends, and its signed POST arrives meanwhile."""
    from tests.service.scheduler.test_notify import Receiver

    hang, ok = Receiver(hang=True), Receiver()
    try:
        with Client(stack.url, stack.admin_token) as c:
            spec = tiny(training={"epochs": 2})
            a = c.json("POST", "/v1/experiments", json={"spec": spec, "notify": {"webhook": hang.url}})["id"]
            b = c.json("POST", "/v1/experiments",
                       json={"spec": spec, "after": [a], "notify": {"webhook": ok.url, "on": ["succeeded"]}})["id"]
            deadline = time.monotonic() + 30
            while not (c.get(b).get("pending_reason") or "").startswith(f"waiting for {a} ("):
                assert time.monotonic() < deadline, c.get(b)
                time.sleep(0.2)
            first, second = wait_state(c, a, {"succeeded"}), wait_state(c, b, {"succeeded", "failed"}, timeout=180)
            assert second["state"] == "succeeded" and second["started_at"] >= first["finished_at"]
            assert hang.wait(1)[0]["id"] == a and not hang.release.is_set()  # still hanging all along
            got = ok.wait(1)[0]
            assert got["id"] == b and got["state"] == "succeeded" and got["summary"]["epochs"] == 2
            ok.verify(c.json("GET", "/v1/me/webhook-secret")["secret"])
    finally:
        hang.close()
        ok.close()
