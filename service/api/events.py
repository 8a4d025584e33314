"""Job event streams for the API: SSE with ``Last-Event-ID`` resume, fanned out from one Redis reader per process.

A follower gets the stream's history first (XRANGE after its last id), then live events. Live events come
from one reader task per API process (the ``Hub``): a single ``XREAD BLOCK`` over every followed job's stream,
so it holds one Redis connection however many jobs and followers there are; each follower has a queue. The
follower subscribes *before* reading the history and skips queued ids it already sent, so nothing falls
between history and live, and nothing is sent twice. The SSE ``id`` is the Redis stream id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from api_schemas import keys
from api_schemas.jobs import TERMINAL, JobState
from service.api.event_vetting import Vetter

Entry = tuple[str, dict[str, str]]
READ_BLOCK_MS = 2000  # the reader's XREAD BLOCK: under redis-py's 5 s socket timeout, which would end it as an error
WAKE_TTL_S = 86400  # a hub's wake stream outlives its process by at most this
REAUTH_S = 2.0  # a live stream re-checks its token this often: a rotated token's stream ends within it
Batch = tuple[list[Entry], bytes]  # entries and their SSE text, encoded once for every follower
ENDED: Batch = ([], b"")  # put in a follower's queue when its job's feed is dropped: its stream ends
RESTART_S = (0.5, 1.0, 2.0, 5.0)  # a crashed reader starts again after these (the last one from then on)
log = logging.getLogger("tlab.api")


def stream_id(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


STREAM_ID_PATTERN = r"^\d{1,20}(-\d{1,20})?$"  # a Redis stream id (``Last-Event-ID``), as the OpenAPI says too


def valid_stream_id(eid: str) -> bool:
    return re.fullmatch(STREAM_ID_PATTERN, eid) is not None


def sse(entries: list[Entry]) -> str:
    """Server-Sent Events text for stream entries: ``id`` = stream id, ``event`` = kind, ``data`` = JSON."""
    return "".join(f"id: {eid}\nevent: {f.get('kind', 'message')}\ndata: {f.get('data', '{}')}\n\n"
                   for eid, f in entries)


class _JobFeed:
    """A followed job: its followers' queues, and the id of the last entry handed to them."""

    def __init__(self, cursor: str) -> None:
        self.subscribers: set[asyncio.Queue[Batch]] = set()
        self.cursor = cursor


class Hub:
    """One reader task per API process: a single ``XREAD BLOCK`` over every followed job's stream, broadcasting
    each job's new entries (one batch, its SSE text encoded once) to every follower's queue of that job.

    The XREAD also reads the hub's own wake stream (``keys.hub_wake``): a follower that has sent a new job's
    history and goes live XADDs to it (at most once per XREAD), so the blocked read returns at once and the next
    one includes the job (a finished job's history wakes nothing). The job's entries are not lost meanwhile:
    its cursor is its last id when it was first followed. A job whose last follower left drops out of the next
    read.

    A job's own code may ``DEL`` its events stream and ``HSET`` the key (its Redis user may, on its own keys): the
    shared XREAD then fails with WRONGTYPE for every job. On an error reply the reader asks ``TYPE`` of the followed
    keys and drops the jobs whose key is no longer a stream (or absent): their followers' streams end, the others go
    on. A reader that dies of anything else is logged and started again while jobs are followed."""

    def __init__(self, client: aioredis.Redis, block_ms: int = READ_BLOCK_MS) -> None:
        self.r = client
        self.block_ms = block_ms
        self.feeds: dict[str, _JobFeed] = {}
        self.wake_key = keys.hub_wake(uuid.uuid4().hex[:16])
        self._reading = False  # an XREAD is out...
        self._round: set[str] = set()  # ...for these jobs...
        self._woken = False  # ...and a wake was sent to end it
        self._busy = asyncio.Event()  # set while jobs are followed: the reader waits on it when none are
        self._task: asyncio.Task[None] | None = None
        self._crashes = 0  # the reader's crashes since its last whole round: its restart's back-off
        self._closed = False

    async def subscribe(self, job_id: str) -> asyncio.Queue[Batch]:
        """A queue that gets the job's entries after its cursor (its last id when first followed), once the
        reader reads the job: at its next XREAD, or at once after ``listen``."""
        queue: asyncio.Queue[Batch] = asyncio.Queue()
        if job_id not in self.feeds:
            last = await self.r.xrevrange(keys.events(job_id), count=1)
            if job_id not in self.feeds:  # another follower of the job may have come meanwhile
                self.feeds[job_id] = _JobFeed(last[0][0] if last else "0-0")
        self.feeds[job_id].subscribers.add(queue)
        self._busy.set()
        if self._task is None or self._task.done():
            self._start(0.0)
        return queue

    def unsubscribe(self, job_id: str, queue: asyncio.Queue[Batch]) -> None:
        feed = self.feeds.get(job_id)
        if feed is None:
            return
        feed.subscribers.discard(queue)
        if not feed.subscribers:
            del self.feeds[job_id]

    async def listen(self, job_id: str) -> None:
        """Have the reader read the job now (a follower goes live): if its blocked XREAD was sent without the
        job, end it with one XADD to the wake stream (one per XREAD, however many jobs wait for it)."""
        if not self._reading or job_id in self._round or self._woken:
            return  # the reader's next XREAD includes the job, or a wake is on its way
        self._woken = True
        try:
            async with self.r.pipeline(transaction=False) as p:
                p.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
                p.expire(self.wake_key, WAKE_TTL_S)
                await p.execute()
        except BaseException:
            self._woken = False
            raise

    def _start(self, delay_s: float) -> None:
        self._task = asyncio.create_task(self._read(delay_s))
        self._task.add_done_callback(self._reader_done)

    def _reader_done(self, task: asyncio.Task[None]) -> None:
        """A reader that died of an exception is logged, and started again after a back-off while jobs are
        followed (a later ``subscribe`` starts one otherwise)."""
        if task.cancelled() or task.exception() is None:
            return
        again = bool(self.feeds) and not self._closed and task is self._task
        delay = RESTART_S[min(self._crashes, len(RESTART_S) - 1)]
        self._crashes += 1
        log.error("the event reader stopped with %d jobs followed: %r; %s", len(self.feeds), task.exception(),
                  f"it starts again in {delay} s" if again else "a new follower starts it again",
                  exc_info=task.exception())
        if again:
            self._start(delay)

    async def _read(self, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        wake_cursor = "0-0"
        while not self._closed:
            if not self.feeds:
                self._busy.clear()
                await self._busy.wait()
                continue
            jobs = {keys.events(j): j for j in self.feeds}
            streams = {key: self.feeds[j].cursor for key, j in jobs.items()} | {self.wake_key: wake_cursor}
            self._round, self._reading, self._woken = set(self.feeds), True, False
            try:
                got = await self.r.xread(streams, block=self.block_ms, count=1000)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis hiccup, or a job's key no stream: the followers keep their queues
                self._reading = False
                if not (isinstance(e, ResponseError) and await self._drop_wrong_types(jobs, e)):
                    await asyncio.sleep(0.5)  # try again shortly
                continue
            self._reading = False
            for key, entries in got or []:
                if key == self.wake_key:
                    wake_cursor = entries[-1][0]
                elif entries:
                    self._deliver(jobs[key], entries)
            self._crashes = 0

    async def _drop_wrong_types(self, jobs: dict[str, str], error: ResponseError) -> bool:
        """After an XREAD error reply: drop the jobs whose events key holds something else than a stream (one
        ``TYPE`` each, in one pipeline) and end their followers' streams; whether there was one."""
        try:
            async with self.r.pipeline(transaction=False) as p:
                for key in jobs:
                    p.type(key)
                types = await p.execute()
        except Exception:
            return False
        wrong = [(jobs[key], kind) for key, kind in zip(jobs, types, strict=True) if kind not in ("stream", "none")]
        for job_id, kind in wrong:
            feed = self.feeds.pop(job_id, None)
            if feed is None:
                continue
            log.warning("job %s: its events key %s is a %s, not a stream (XREAD: %s): its %d live event "
                        "stream(s) end", job_id, keys.events(job_id), kind, error, len(feed.subscribers))
            for q in feed.subscribers:
                q.put_nowait(ENDED)
        return bool(wrong)

    def _deliver(self, job_id: str, entries: list[Entry]) -> None:
        """Entries after the job's cursor to every follower (the job may have been dropped and followed again
        while the XREAD was out: its new cursor decides)."""
        feed = self.feeds.get(job_id)
        if feed is None:
            return
        after = stream_id(feed.cursor)
        fresh = [e for e in entries if stream_id(e[0]) > after]
        if not fresh:
            return
        feed.cursor = fresh[-1][0]
        batch = (fresh, sse(fresh).encode())
        for q in feed.subscribers:
            q.put_nowait(batch)

    async def close(self) -> None:
        """Stop the reader: cancelled again until it has stopped (on Python 3.11 a cancel that lands as redis-py's
        ``wait_for`` around a send completes is lost: gh-86296), and it would stop at its next XREAD anyway."""
        self._closed = True
        while self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=0.1)
        self._task = None
        self.feeds.clear()
        with contextlib.suppress(Exception):
            await self.r.delete(self.wake_key)


async def follow(hub: Hub, job_id: str, last_id: str | None, heartbeat_s: float,
                 still_valid: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[str | bytes]:
    """SSE text for a job: history after ``last_id``, then live until the ``end`` event; a comment
    line every ``heartbeat_s`` of silence keeps proxies and clients from timing out. While live, the
    caller's token is re-checked every ``REAUTH_S``: once it is rotated or its user disabled, the stream
    ends, and the client's reconnect (with ``Last-Event-ID``) is answered 401. A job whose events key is no
    stream (its code made it a hash) ends the stream, as the hub does for its live followers."""
    queue: asyncio.Queue[Batch] | None = None
    sent = stream_id(last_id) if last_id else (0, 0)
    vetter = Vetter(hub.r, job_id)  # a job's own entries are data: never a state or an end of its stream
    try:
        queue = await hub.subscribe(job_id)
        yield "retry: 2000\n\n"
        cursor = f"({last_id}" if last_id else "-"
        ended = False
        while True:
            while True:  # history, in pages
                page = await hub.r.xrange(keys.events(job_id), min=cursor, max="+", count=1000)
                if not page:
                    break
                good = await vetter.vet(page)
                if good:
                    yield sse(good)
                sent = stream_id(page[-1][0])
                if any(f.get("kind") == "end" for _, f in good):
                    return
                cursor = f"({page[-1][0]}"
            if ended:  # a resume past the end: nothing live will come
                return
            # the end is written with the ended state in one script: once the state says so, one more read has it
            state = await hub.r.hget(keys.job(job_id), "state")
            ended = state is not None and JobState(state) in TERMINAL  # no record (a bare stream): live events
            if not ended:
                break
        await hub.listen(job_id)
        gate = _Reauth(still_valid)
        quiet = 0.0
        while True:  # live
            step = min(heartbeat_s, REAUTH_S)
            try:
                batch, text = await asyncio.wait_for(queue.get(), timeout=step)
            except TimeoutError:
                if not await gate.ok():
                    return
                quiet += step
                if quiet >= heartbeat_s:
                    quiet = 0.0
                    yield ": keep-alive\n\n"
                continue
            if not batch or not await gate.ok():  # the hub dropped the job (its key is no stream), or a token
                return
            fresh = [e for e in batch if stream_id(e[0]) > sent]  # less what the history already sent
            if not fresh:
                continue
            good = await vetter.vet(fresh)
            if good:  # the usual case, all new and all vetted: the hub's shared text
                yield text if len(good) == len(batch) else sse(good)
            sent = stream_id(fresh[-1][0])
            if any(f.get("kind") == "end" for _, f in good):
                return
    except ResponseError as e:  # e.g. WRONGTYPE: the job's key is a hash now
        log.warning("job %s: its events cannot be read (%s): a stream of them ends", job_id, e)
    finally:
        if queue is not None:
            hub.unsubscribe(job_id, queue)


class _Reauth:
    """Asks ``still_valid`` at most every ``REAUTH_S`` (one Redis GET while nothing about users changed)."""

    def __init__(self, still_valid: Callable[[], Awaitable[bool]] | None) -> None:
        self.still_valid, self.checked = still_valid, time.monotonic()

    async def ok(self) -> bool:
        if self.still_valid is None or time.monotonic() - self.checked < REAUTH_S:
            return True
        self.checked = time.monotonic()
        return await self.still_valid()


def records(entries: list[Entry]) -> list[dict[str, Any]]:
    """The runner records (``kind`` epoch/teleport/log/status...) carried by stream entries."""
    out = []
    for _eid, f in entries:
        try:
            out.append(json.loads(f.get("data", "{}")))
        except json.JSONDecodeError:
            continue
    return out


def downsample(rows: list[dict[str, Any]], max_points: int | None) -> list[dict[str, Any]]:
    """At most ``max_points`` rows, evenly spaced, always keeping the first and the last."""
    n = len(rows)
    if not max_points or n <= max_points:
        return rows
    if max_points == 1:
        return [rows[-1]]
    step = (n - 1) / (max_points - 1)
    return [rows[min(n - 1, math.floor(i * step + 0.5))] for i in range(max_points)]
