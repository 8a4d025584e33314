"""A job cannot fill Redis: its Redis user touches its own keys only, by their exact names; every write the workers
make goes through a script the service loaded, which refuses an entry over its cap and a write past the job's share
(``TLAB_JOB_REDIS_MB``) before anything lands; deleting the job removes every key under its hash. Driven as the job's
own ACL user (the URL its one-time ticket redeems to), on a real redis-server and, for the DELETE, the real API."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import redis

from api_schemas import keys
from api_schemas.jobs import ExperimentSubmit, JobState
from api_schemas.spec import ExperimentSpec
from service.core.settings import Settings
from service.core.store import Store
from service.launch.job_acl import JobAcl, user_name
from tests.service.conftest import Api, tiny
from workers.job.record import write_field
from workers.job.redis_sink import RedisSink, read_events
from workers.job.ticket import redeem
from workers.sweep import TrialTable

NOPERM = redis.exceptions.NoPermissionError


def own(job: str) -> list[str]:
    """The keys the workers write, events stream and emitted hash first (the sink's script's order)."""
    return [keys.events(job), keys.emitted(job), keys.trials(job), keys.job_run(job), keys.preflight(job)]


def job_user(store: Store, settings: Settings, job: str) -> str:
    """The job moved to starting, as dispatch does, and the URL its driver redeems from the scheduler's ticket."""
    store.transition(job, JobState.STARTING, expect=[JobState.QUEUED], ray_job_id=f"tlab-{job}-1", attempts="1")
    ticket = JobAcl(store.r, settings).credentials(job, f"tlab-{job}-1")[keys.JOB_TICKET_ENV]
    return redeem(ticket)


def submitted(store: Store) -> str:
    return store.submit("alice", ExperimentSubmit(spec=ExperimentSpec.model_validate(tiny())))[0]


def used(r: redis.Redis, job: str) -> int:
    return sum(int(r.memory_usage(k, samples=0) or 0) for k in own(job))


def test_a_jobs_user_cannot_write_a_key_of_its_own_choosing(redis_server: str) -> None:
    """Under ``tlab:job:<id>:`` only the keys the workers write: a key of the job's choosing (raw or through the
    service's script), the service's ``notified`` record and the job hash are refused; its own keys are not."""
    store = Store.from_url(redis_server)
    job = submitted(store)
    url = job_user(store, Settings(redis_url=redis_server), job)
    r = redis.Redis.from_url(url, decode_responses=True)
    junk = f"{keys.job(job)}:junk"
    sha = RedisSink(url, job).script.sha
    for call in (lambda: r.hset(junk, "x", "y" * 1000), lambda: r.xadd(junk, {"kind": "log", "data": "{}"}),
                 lambda: r.hsetnx(junk, "x", "1"), lambda: r.delete(junk),
                 lambda: r.evalsha(sha, 2, junk, keys.emitted(job), 1000, "", "log", "{}"),
                 lambda: r.hset(keys.notified(job), "succeeded:1", "{}"),
                 lambda: r.hset(keys.job(job), "state", "succeeded")):
        with pytest.raises(NOPERM):
            call()
    assert sorted(store.r.scan_iter(match=f"{keys.job(job)}:*")) == sorted([keys.events(job), keys.job_run(job)])
    sink = RedisSink(url, job)  # its own keys: still written, through the service's script
    sink.emit({"kind": "epoch", "epoch": 0, "train_loss": 1.0})
    sink.close()
    write_field(r, job, "summary", json.dumps({"epochs": 1}))
    assert [e["data"]["epoch"] for e in read_events(url, job) if e["kind"] == "metric"] == [0]
    assert json.loads(store.r.hget(keys.job_run(job), "summary")) == {"epochs": 1}
    r.close()
    store.r.close()


def test_an_oversized_entry_is_refused_before_it_lands(redis_server: str) -> None:
    """With a 1-MiB share (entries of at most 64 KiB): an event, a field of its ``run`` copy, a trials row over the
    entry cap are refused with a line naming the cap, nothing of them in Redis; the sink writes a warning instead of
    an oversized event; and a job filling its share through the scripts is refused at it, never past it."""
    store = Store.from_url(redis_server)
    job = submitted(store)
    url = job_user(store, Settings(redis_url=redis_server, job_redis_mb=1), job)
    r = redis.Redis.from_url(url, decode_responses=True)
    big = "x" * (100 * 1024)
    sink = RedisSink(url, job, batch_size=1)
    before = store.r.xlen(keys.events(job))
    with pytest.raises(redis.ResponseError, match="per entry"):  # the script the service loaded, called directly
        r.evalsha(sink.script.sha, 5, *own(job), 1000, "epoch:9", "metric", big)
    assert store.r.xlen(keys.events(job)) == before and not store.r.hexists(keys.emitted(job), "epoch:9")
    with pytest.raises(RuntimeError, match="TLAB_JOB_REDIS_MB"):
        write_field(r, job, "summary", big)
    assert not store.r.hexists(keys.job_run(job), "summary")
    table = TrialTable(url, job, "train_loss", "min", epochs=1)
    trial = SimpleNamespace(trial_id="t0", config={"pad": big}, last_result={})
    with pytest.raises(RuntimeError, match="TLAB_JOB_REDIS_MB"):
        table.update(trial, state="running")
    assert not store.r.exists(keys.trials(job))
    sink.emit({"kind": "log", "level": "info", "message": big})  # the job's own sink: a warning in its place
    last = read_events(url, job)[-1]["data"]
    assert last["level"] == "warning" and "over the cap of 65536 bytes" in last["message"], last
    assert max(len(f["data"]) for _, f in store.r.xrange(keys.events(job))) < 1024

    event = json.dumps({"kind": "log", "level": "info", "message": "y" * 30_000})
    landed, refusal = 0, ""
    for _ in range(200):  # 6 MB offered, 30 KB at a time: refused at the 1-MiB share
        try:
            r.evalsha(sink.script.sha, 5, *own(job), 100_000, "", "log", event)
            landed += 1
        except redis.ResponseError as err:
            refusal = str(err)
            break
    assert "share of 1048576 (TLAB_JOB_REDIS_MB)" in refusal, refusal
    assert 30 <= landed <= 35 and used(store.r, job) <= 2**20, (landed, used(store.r, job))  # exact, not sampled
    with pytest.raises(RuntimeError, match="share of 1048576"):
        write_field(r, job, "summary", "z" * 40_000)
    sink.close()
    r.close()
    store.r.close()


def test_delete_leaves_no_key_of_the_job(api_only: Api, redis_server: str) -> None:
    """The job writes its keys as its own user (and tries one of its choosing), an older release's user left one
    more under its hash; ``DELETE /v1/experiments/<id>`` once it has ended leaves no ``tlab:job:<id>*`` key, and
    no Redis user of the job."""
    store = Store.from_url(redis_server)
    with api_only.client() as c:
        job = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
    url = job_user(store, Settings(redis_url=redis_server), job)
    r = redis.Redis.from_url(url, decode_responses=True)
    sink = RedisSink(url, job)
    sink.emit({"kind": "epoch", "epoch": 0, "train_loss": 1.0})
    sink.close()
    write_field(r, job, "summary", "{}")
    TrialTable(url, job, "train_loss", "min", epochs=1).update(SimpleNamespace(trial_id="t0", config={},
                                                                               last_result={}), state="running")
    r.hset(keys.preflight(job), "result", "{}")
    try:
        r.hset(f"{keys.job(job)}:mine", "x", "y")  # refused: a key of its own choosing
    except redis.exceptions.NoPermissionError:
        pass
    store.r.hset(f"{keys.job(job)}:left", "x", "y")  # a key an older release's job user could make
    store.r.hset(keys.notified(job), "cancelled:1", "{}")
    assert store.transition(job, JobState.CANCELLED, expect=[JobState.STARTING])
    with api_only.client() as c:
        assert c.delete(f"/v1/experiments/{job}").status_code == 204
        assert c.get(f"/v1/experiments/{job}").status_code == 404
    assert sorted(store.r.scan_iter(match=f"{keys.job(job)}*", count=1000)) == []
    assert user_name(job) not in store.r.acl_users()
    with pytest.raises((redis.AuthenticationError, redis.ConnectionError)):  # its connections closed with it
        r.ping()
    store.r.close()
