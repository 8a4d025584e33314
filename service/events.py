"""Job event streams for the API: SSE with ``Last-Event-ID`` resume, fanned out from one Redis reader per job.

A follower gets the stream's history first (XRANGE after its last id), then live events. Live
events come from one ``XREAD BLOCK`` loop per job per API process (the ``Hub``), however many
followers there are; each follower has a queue. The follower subscribes *before* reading the
history and skips queued ids it already sent, so nothing falls between history and live, and
nothing is sent twice. The SSE ``id`` is the Redis stream id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from api_schemas import keys

Entry = tuple[str, dict[str, str]]
REAUTH_S = 2.0  # a live stream re-checks its token this often: a rotated token's stream ends within it
Batch = tuple[list[Entry], bytes]  # entries and their SSE text, encoded once for every follower


def stream_id(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def valid_stream_id(eid: str) -> bool:
    try:
        stream_id(eid)
    except ValueError:
        return False
    return True


def sse(entries: list[Entry]) -> str:
    """Server-Sent Events text for stream entries: ``id`` = stream id, ``event`` = kind, ``data`` = JSON."""
    return "".join(f"id: {eid}\nevent: {f.get('kind', 'message')}\ndata: {f.get('data', '{}')}\n\n"
                   for eid, f in entries)


class _JobFeed:
    def __init__(self) -> None:
        self.subscribers: set[asyncio.Queue[Batch]] = set()
        self.task: asyncio.Task[None] | None = None


class Hub:
    """One XREAD loop per followed job, broadcasting batches of entries to every follower's queue."""

    def __init__(self, client: aioredis.Redis, block_ms: int = 5000) -> None:
        self.r = client
        self.block_ms = block_ms
        self.feeds: dict[str, _JobFeed] = {}

    async def subscribe(self, job_id: str) -> asyncio.Queue[Batch]:
        feed = self.feeds.get(job_id)
        if feed is None:
            feed = self.feeds[job_id] = _JobFeed()
            last = await self.r.xrevrange(keys.events(job_id), count=1)
            start = last[0][0] if last else "0-0"
            feed.task = asyncio.create_task(self._pump(job_id, feed, start))
        queue: asyncio.Queue[Batch] = asyncio.Queue()
        feed.subscribers.add(queue)
        return queue

    def unsubscribe(self, job_id: str, queue: asyncio.Queue[Batch]) -> None:
        feed = self.feeds.get(job_id)
        if feed is None:
            return
        feed.subscribers.discard(queue)
        if not feed.subscribers and feed.task is not None:
            feed.task.cancel()
            del self.feeds[job_id]

    async def _pump(self, job_id: str, feed: _JobFeed, cursor: str) -> None:
        key = keys.events(job_id)
        while True:
            try:
                got = await self.r.xread({key: cursor}, block=self.block_ms, count=1000)
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis hiccup: the followers keep their queues; try again shortly
                await asyncio.sleep(0.5)
                continue
            for _key, entries in got or []:
                if entries:
                    cursor = entries[-1][0]
                    batch = (entries, sse(entries).encode())
                    for q in feed.subscribers:
                        q.put_nowait(batch)

    async def close(self) -> None:
        for feed in self.feeds.values():
            if feed.task is not None:
                feed.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feed.task
        self.feeds.clear()


async def follow(hub: Hub, job_id: str, last_id: str | None, heartbeat_s: float,
                 still_valid: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[str | bytes]:
    """SSE text for a job: history after ``last_id``, then live until the ``end`` event; a comment
    line every ``heartbeat_s`` of silence keeps proxies and clients from timing out. While live, the
    caller's token is re-checked every ``REAUTH_S``: once it is rotated or its user disabled, the stream
    ends, and the client's reconnect (with ``Last-Event-ID``) is answered 401."""
    queue = await hub.subscribe(job_id)
    sent = stream_id(last_id) if last_id else (0, 0)
    try:
        yield "retry: 2000\n\n"
        cursor = f"({last_id}" if last_id else "-"
        while True:  # history, in pages
            page = await hub.r.xrange(keys.events(job_id), min=cursor, max="+", count=1000)
            if not page:
                break
            yield sse(page)
            sent = stream_id(page[-1][0])
            if any(f.get("kind") == "end" for _, f in page):
                return
            cursor = f"({page[-1][0]}"
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
            if not await gate.ok():
                return
            if stream_id(batch[0][0]) > sent:  # the usual case: all new, send the shared text
                fresh = batch
                yield text
            else:  # overlaps the history this follower already sent
                fresh = [e for e in batch if stream_id(e[0]) > sent]
                if not fresh:
                    continue
                yield sse(fresh)
            sent = stream_id(fresh[-1][0])
            if any(f.get("kind") == "end" for _, f in fresh):
                return
    finally:
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
