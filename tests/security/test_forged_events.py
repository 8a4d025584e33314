"""A job cannot make its followers believe it ended: the SSE relay passes a ``status`` that claims a state, or an
``end``, only when the service listed its id *and* the digest of its content (``service_events`` in the job hash,
which the job's Redis user cannot write). The job here, as its own ACL user (the URL its one-time ticket redeems
to), deletes its stream and adds ``status: succeeded`` and ``end`` under the ids the service listed, while the real
API (over HTTP, as ``tlab submit --follow`` reads it) follows the job; a real redis-server."""

from __future__ import annotations

import json
import time

import redis

from api_schemas import keys
from api_schemas.jobs import JobState
from service.core.settings import Settings
from service.core.store import Store
from service.launch.job_acl import JobAcl
from tests.service.conftest import Api, tiny
from workers.job.redis_sink import RedisSink
from workers.job.ticket import redeem


def listed(r: redis.Redis, job: str) -> list[str]:
    """The stream ids the service listed as its own, oldest first."""
    raw = r.hget(keys.job(job), "service_events") or ""
    return [item.partition("=")[0] for item in raw.split(",") if item]


def follow(api: Api, job: str, store: Store, end_after_s: float) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The job's SSE events (``id``, ``event``, ``data``) as a follower gets them: those before the service ends the
    job ``end_after_s`` into the stream (if it is still open then), and all of them until an ``end``."""
    events: list[dict[str, str]] = []
    before: list[dict[str, str]] | None = None
    with api.client() as c, c.stream("GET", f"/v1/experiments/{job}/events", timeout=30) as resp:
        assert resp.status_code == 200
        started, block = time.monotonic(), {}
        for line in resp.iter_lines():  # the API's heartbeat (0.5 s) keeps lines coming
            if line == "":
                if "id" in block:
                    events.append(block)
                if block.get("event") == "end":
                    break
                block = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(": ")
                block[name] = value
            if before is None and time.monotonic() - started > end_after_s:
                before = list(events)
                assert store.transition(job, JobState.CANCELLED, expect=[JobState.RUNNING])
            assert time.monotonic() - started < 30, events
    return (events if before is None else before), events


def test_a_stream_rewritten_under_the_services_ids_is_not_relayed(api_only: Api, redis_server: str) -> None:
    store = Store.from_url(redis_server)
    with api_only.client() as c:
        job = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
    sid = f"tlab-{job}-1"
    store.transition(job, JobState.STARTING, expect=[JobState.QUEUED], ray_job_id=sid, attempts="1")
    store.transition(job, JobState.RUNNING, expect=[JobState.STARTING])
    url = redeem(JobAcl(store.r, Settings(redis_url=redis_server)).credentials(job, sid)[keys.JOB_TICKET_ENV])
    queued, starting, running = listed(store.r, job)
    own = redis.Redis.from_url(url, decode_responses=True)
    stream, now = keys.events(job), time.time()
    assert own.delete(stream) == 1
    forged = [own.xadd(stream, {"kind": "status", "data": json.dumps({"kind": "status", "state": "succeeded",
                                                                       "at": now})}, id=starting),
              own.xadd(stream, {"kind": "end", "data": json.dumps({"kind": "end", "state": "succeeded", "at": now})},
                       id=running)]
    assert forged == [starting, running]
    sink = RedisSink(url, job)  # the job's own metrics still go through
    sink.emit({"kind": "epoch", "epoch": 0, "train_loss": 1.0, "test_loss": 1.0})
    sink.close()
    own.close()
    with api_only.client() as c:
        assert c.get(f"/v1/experiments/{job}").json()["state"] == "running"

    before, events = follow(api_only, job, store, end_after_s=3.0)
    # while the job runs, its follower gets its metric and no state, no end: `--follow` does not stop
    assert [e["event"] for e in before] == ["metric"], before
    assert not {e["id"] for e in events} & set(forged) and not any("succeeded" in e["data"] for e in events), events
    # the service's own end (a new id, listed with its digest) ends the stream, with the real state
    assert [e["event"] for e in events] == ["metric", "status", "end"], events
    assert json.loads(events[-1]["data"])["state"] == "cancelled"
    with api_only.client() as c:
        assert c.get(f"/v1/experiments/{job}").json()["state"] == "cancelled"
    assert queued not in {e["id"] for e in events}
    store.r.close()
