"""Live events for many followed jobs through one Redis reader per API process (``service.api.events.Hub``), and the
process's cap on open SSE streams (``TLAB_MAX_STREAMS``): a real Redis, the real API process, real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from api_schemas import keys
from api_schemas.jobs import JobState
from service.api.deps import ASYNC_CLIENT_NAME
from service.api.events import Hub
from service.api.events import follow as live
from service.core.store import Store
from service.launch.job_acl import job_url, rules, user_name
from tests.service.conftest import Api, tiny

JOBS = 80  # followed at once, one stream each, by one user
POOL = 8  # the API's async Redis connections: a tenth of the followed jobs


@pytest.fixture()
def api_env() -> dict[str, str]:
    """A small async pool, room for all of alice's streams, and a process cap of one stream more than hers."""
    return {"TLAB_REDIS_POOL": str(POOL), "TLAB_MAX_STREAMS": str(JOBS + 1),
            "TLAB_MAX_STREAMS_PER_USER": str(JOBS + 5)}


@pytest.fixture()
def rds(redis_server: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    yield r
    r.close()


def publish(r: redis.Redis, jobs: list[str], kind: str = "metric") -> None:
    """One event in each job's stream (one round trip for all)."""
    with r.pipeline(transaction=False) as p:
        for job in jobs:
            p.xadd(keys.events(job), {"kind": kind, "data": json.dumps({"at": time.time()})})
        p.execute()


def end(r: redis.Redis, jobs: list[str]) -> None:
    """End each (queued) job as the service does: its transition writes the `status` and `end` entries whose ids
    the relay knows are the service's (a raw XADD of an `end` is a job's forgery, not relayed)."""
    store = Store(r)
    for job in jobs:
        assert store.transition(job, JobState.CANCELLED), job


def api_clients(r: redis.Redis) -> tuple[int, int]:
    """The API's async Redis connections now: (open, blocked in a command such as XREAD BLOCK)."""
    mine = [c for c in r.client_list() if c.get("name") == ASYNC_CLIENT_NAME]
    return len(mine), sum("b" in c.get("flags", "") for c in mine)


async def follow(client: httpx.AsyncClient, job: str, opened: set[str]) -> list[tuple[str, str]]:
    """(id, event) of every event the job's SSE stream sends until ``end``; ``job`` joins ``opened`` once the API
    has subscribed it (its first bytes)."""
    got: list[tuple[str, str]] = []
    async with client.stream("GET", f"/v1/experiments/{job}/events") as resp:
        assert resp.status_code == 200, await resp.aread()
        buf = ""
        async for chunk in resp.aiter_text():
            opened.add(job)
            buf += chunk
            while "\n\n" in buf:
                block, buf = buf.split("\n\n", 1)
                fields = dict(line.split(": ", 1) for line in block.split("\n") if line[:1] not in ("", ":"))
                if "id" in fields:
                    got.append((fields["id"], fields["event"]))
                if fields.get("event") == "end":
                    return got
    return got


async def until(check: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_followers_of_many_jobs_share_one_reader_and_the_process_caps_streams(api_only: Api,
                                                                            rds: redis.Redis) -> None:
    api = api_only
    api.add_user("alice")
    api.add_user("bob")
    with api.client("alice") as c:
        jobs = [c.post("/v1/experiments", json={"spec": tiny()}).json()["id"] for _ in range(JOBS)]
    with api.client("bob") as c:
        bobs = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
    publish(rds, jobs)  # history before anyone follows
    asyncio.run(asyncio.wait_for(_scenario(api, rds, jobs, bobs), timeout=120))


async def _scenario(api: Api, rds: redis.Redis, jobs: list[str], bobs: str) -> None:
    def client(user: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=api.url, headers={"Authorization": f"Bearer {api.tokens[user]}"},
                                 timeout=30, limits=httpx.Limits(max_connections=JOBS + 10))

    async with client("alice") as alice, client("bob") as bob:
        opened: set[str] = set()
        followers = [asyncio.create_task(follow(alice, job, opened)) for job in jobs]
        try:
            await _hold(rds, jobs, bobs, bob, followers, opened)
        finally:
            for f in followers:
                f.cancel()
            await asyncio.gather(*followers, return_exceptions=True)


async def _hold(rds: redis.Redis, jobs: list[str], bobs: str, bob: httpx.AsyncClient,
                followers: list[asyncio.Task[list[tuple[str, str]]]], opened: set[str]) -> None:
    """Alice's 80 streams held while bob streams beside them and one stream over the cap is refused; then
    every follower gets the rest of its job's events, exactly once and in order."""
    while len(opened) < JOBS:  # events land while the followers subscribe and read their history
        assert not any(f.done() for f in followers), [f.result() for f in followers if f.done()]
        await asyncio.to_thread(publish, rds, jobs)
        await asyncio.sleep(0.05)
    samples = []
    for _ in range(5):  # all 80 held: one XREAD for all of them, the pool never over its size
        samples.append(await asyncio.to_thread(api_clients, rds))
        await asyncio.sleep(0.1)
    assert max(n for n, _ in samples) <= POOL and max(b for _, b in samples) == 1, samples

    bob_opened: set[str] = set()  # another user's stream opens beside them and gets its events live
    bob_follows = asyncio.create_task(follow(bob, bobs, bob_opened))
    await until(lambda: bob_opened, "bob's stream never opened beside alice's 80")
    async with bob.stream("GET", f"/v1/experiments/{bobs}/events") as over:  # the process's 82nd
        body = json.loads(await over.aread())
        assert over.status_code == 429 and over.headers["Retry-After"], body
        assert f"{JOBS + 1} event streams" in body["detail"] and "TLAB_MAX_STREAMS)" in body["detail"], body
        assert body["errors"][0]["field"] == "events", body
    publish(rds, [bobs])  # a failure deadline, not a bound: that the wake reads a job at once is the next test's
    await asyncio.to_thread(end, rds, [bobs])
    bob_got = await asyncio.wait_for(bob_follows, 30)
    assert bob_got == [(eid, f["kind"]) for eid, f in rds.xrange(keys.events(bobs))], bob_got
    assert [kind for _, kind in bob_got[-3:]] == ["metric", "status", "end"], bob_got

    publish(rds, jobs)
    await asyncio.to_thread(end, rds, jobs)
    got = await asyncio.wait_for(asyncio.gather(*followers), 30)
    for job, events in zip(jobs, got, strict=True):  # every event exactly once, in order, history and live
        assert events == [(eid, f["kind"]) for eid, f in rds.xrange(keys.events(job))], job
        assert len(events) >= 4 and events[-1][1] == "end"


def test_a_newly_followed_job_is_read_at_once_and_a_left_one_is_dropped(redis_server: str,
                                                                        rds: redis.Redis) -> None:
    """The reader blocks for 60 s, yet a job followed while it waits gets its events before a 20-s deadline: its
    blocked XREAD ends at once (the wake stream) rather than when its block does (a failure without the wake, not
    a measured time), with one blocked connection throughout."""
    a, b = "18f3a2b4c5d-0000e1", "18f3a2b4c5d-0000e2"

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_server, decode_responses=True, client_name=ASYNC_CLIENT_NAME,
                                         socket_timeout=90)  # above the block, which would end it as an error
        hub = Hub(client, block_ms=60_000)
        try:
            qa = await hub.subscribe(a)
            await until(lambda: api_clients(rds)[1] == 1, "the reader never blocked")
            qb = await hub.subscribe(b)
            await hub.listen(b)
            publish(rds, [b])
            entries, text = await asyncio.wait_for(qb.get(), 20)  # TimeoutError: it waited for the 60-s block
            assert [e[0] for e in entries] == [e[0] for e in rds.xrange(keys.events(b))]
            assert text.startswith(b"id: ") and qa.empty()
            await until(lambda: api_clients(rds)[1] == 1, "the reader did not block again on both jobs")
            assert api_clients(rds)[1] == 1
            hub.unsubscribe(b, qb)
            assert set(hub.feeds) == {a}
            publish(rds, [a, b])
            entries, _ = await asyncio.wait_for(qa.get(), 15)
            assert [e[0] for e in entries] == [e[0] for e in rds.xrange(keys.events(a))]
            assert rds.exists(hub.wake_key)
        finally:
            await hub.close()
            await client.aclose()
        assert not rds.exists(hub.wake_key)

    asyncio.run(asyncio.wait_for(run(), timeout=60))


def test_a_job_that_makes_its_stream_a_hash_ends_its_own_followers_only(redis_server: str, rds: redis.Redis,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A followed job's code, as the job's own Redis user (service/launch/job_acl.py's rules), deletes its events stream
    and makes the key a hash: the shared XREAD fails with WRONGTYPE. The hub drops that job (its follower's stream
    ends, a log line says why; a new follower's ends at once) and the other job's follower goes on getting its
    events."""
    good, bad = "18f3a2b4c5d-0000f1", "18f3a2b4c5d-0000f2"
    publish(rds, [good, bad])
    rds.execute_command("ACL", "SETUSER", user_name(bad), *rules(bad, "job-secret"))
    job = redis.Redis.from_url(job_url(redis_server, user_name(bad), "job-secret"))
    try:
        with caplog.at_level(logging.WARNING, logger="tlab.api"):
            asyncio.run(asyncio.wait_for(_poisoned(redis_server, rds, job, good, bad), timeout=60))
    finally:
        job.close()
        rds.acl_deluser(user_name(bad))
    assert any(bad in r.getMessage() and "is a hash, not a stream" in r.getMessage() for r in caplog.records), \
        caplog.text


async def _poisoned(redis_server: str, rds: redis.Redis, job: redis.Redis, good: str, bad: str) -> None:
    client = aioredis.Redis.from_url(redis_server, decode_responses=True)
    hub = Hub(client)
    got: dict[str, list[str]] = {good: [], bad: []}
    readers = {j: asyncio.create_task(sse_ids(live(hub, j, None, 30.0), got[j])) for j in got}
    try:
        await until(lambda: all(got.values()), "the history never came")
        publish(rds, [good, bad])
        await until(lambda: all(len(ids) == 2 for ids in got.values()), "the live events never came")
        job.delete(keys.events(bad))
        job.hset(keys.events(bad), "kind", "not a stream")
        publish(rds, [good])  # ends the XREAD blocked on both: the next one fails
        await asyncio.wait_for(readers[bad], 20)  # TimeoutError before the fix: no XREAD succeeds again
        assert len(got[bad]) == 2 and set(hub.feeds) == {good}
        late: list[str] = []  # a new follower of the job: its stream ends at once, no error
        await asyncio.wait_for(sse_ids(live(hub, bad, None, 30.0), late), 20)
        assert late == [] and set(hub.feeds) == {good}
        publish(rds, [good])
        publish(rds, [good], "end")
        await asyncio.wait_for(readers[good], 20)
        assert got[good] == [eid for eid, _ in rds.xrange(keys.events(good))] and len(got[good]) == 5, got
    finally:
        for r in readers.values():
            r.cancel()
        await asyncio.gather(*readers.values(), return_exceptions=True)
        await hub.close()
        await client.aclose()


async def sse_ids(stream: AsyncIterator[str | bytes], ids: list[str]) -> None:
    """The ``id`` of every event a job's SSE text (``service.api.events.follow``) sends, into ``ids``, until it ends."""
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            text = chunk.decode() if isinstance(chunk, bytes) else chunk
            ids.extend(line[4:] for line in text.split("\n") if line.startswith("id: "))


def test_a_reader_that_dies_is_logged_and_started_again(redis_server: str, rds: redis.Redis,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The reader dies of a bug (here: a client without ``decode_responses``, whose stream names come back as
    bytes: a KeyError); it is logged with its traceback and, while its job is followed, started again: once the
    cause is gone, the follower gets the event."""
    a = "18f3a2b4c5d-0000f3"

    async def run() -> None:
        raw = aioredis.Redis.from_url(redis_server)
        fixed = aioredis.Redis.from_url(redis_server, decode_responses=True)
        hub = Hub(raw)
        try:
            queue = await hub.subscribe(a)  # no history: its cursor is 0-0
            publish(rds, [a])
            await until(lambda: any("event reader stopped" in r.getMessage() and r.exc_info
                                    for r in caplog.records), "the reader's death was not logged")
            hub.r = fixed
            entries, _ = await asyncio.wait_for(queue.get(), 20)  # TimeoutError before: the reader stayed dead
            assert [e[0] for e in entries] == [eid for eid, _ in rds.xrange(keys.events(a))]
        finally:
            await hub.close()
            await raw.aclose()
            await fixed.aclose()

    with caplog.at_level(logging.ERROR, logger="tlab.api"):
        asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert "KeyError" in caplog.text


def test_a_job_cannot_say_a_state_or_end_its_followers_stream(api_only: Api, rds: redis.Redis,
                                                              redis_server: str) -> None:
    """As the job's own Redis user (its raw XADD), a job writes a `status` claiming `succeeded` (the service's shape:
    state and at), an `end`, an entry of no known kind and one whose data is no object: its followers get its
    metrics and its own status record (no `at`: data) only, their stream goes on past the forged `end`, and ends at
    the service's own."""
    with api_only.client() as c:
        job = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
    rds.execute_command("ACL", "SETUSER", user_name(job), *rules(job, "job-secret"))
    own = redis.Redis.from_url(job_url(redis_server, user_name(job), "job-secret"), decode_responses=True)
    try:
        stream = keys.events(job)
        metric = {"kind": "metric", "data": json.dumps({"epoch": 0, "train_loss": 1.0, "test_loss": 1.0})}
        own.xadd(stream, metric)
        forged = [own.xadd(stream, {"kind": "status", "data": json.dumps({"kind": "status", "state": "succeeded",
                                                                           "at": time.time()})}),
                  own.xadd(stream, {"kind": "end", "data": json.dumps({"kind": "end", "state": "succeeded"})}),
                  own.xadd(stream, {"kind": "bogus", "data": "{}"}),
                  own.xadd(stream, {"kind": "metric", "data": "[1, 2]"})]
        own.xadd(stream, {"kind": "status", "data": json.dumps({"kind": "status", "state": "running", "pid": 1})})
        own.xadd(stream, metric)
    finally:
        own.close()
        rds.acl_deluser(user_name(job))
    end(rds, [job])
    with api_only.client() as c:
        r = c.get(f"/v1/experiments/{job}/events", timeout=30)
    ids = [line[4:] for line in r.text.split("\n") if line.startswith("id: ")]
    events = [line[7:] for line in r.text.split("\n") if line.startswith("event: ")]
    every = [eid for eid, _ in rds.xrange(keys.events(job))]
    assert ids == [eid for eid in every if eid not in forged], (ids, forged)
    assert events == ["status", "metric", "status", "metric", "status", "end"], events  # the job's own status too



@pytest.mark.timeout(60)  # (a stream that waits keeps sending heartbeats: only the test's timeout ends it)
def test_a_resume_past_an_ended_jobs_end_ends_at_once(api_only: Api) -> None:
    """A ``Last-Event-ID`` after the ``end`` (any id the schema allows): nothing live will come, so the stream ends
    instead of waiting for ever; one before the end resumes up to it."""
    with api_only.client() as c:
        job = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
        assert c.post(f"/v1/experiments/{job}/cancel").json()["state"] == "cancelled"
        r = c.get(f"/v1/experiments/{job}/events", headers={"Last-Event-ID": "99999999999999999999-0"})
        assert r.status_code == 200 and "event: " not in r.text, r.text
        ids = [line.split(": ", 1)[1] for line in c.get(f"/v1/experiments/{job}/events").text.splitlines()
               if line.startswith("id: ")]
        resumed = c.get(f"/v1/experiments/{job}/events", headers={"Last-Event-ID": ids[0]}).text
        assert "event: end" in resumed and f"id: {ids[0]}\n" not in resumed, resumed
