"""Rank 0's metric sink into the job's Redis stream: batched, capped, exactly-once per epoch.

Its writes go through the bounded script the scheduler loaded (``api_schemas.redis_scripts.xadd_once``, with the caps
of the job's ``run`` copy): an event over the per-entry cap is replaced here by a warning saying so, and a batch that
would take the job's keys past its share of Redis is refused whole (``ShareFull``: the job stops, saying why), as is
one of an attempt the job's record has moved past (``AttemptEnded``: ``workers.job.fence``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from api_schemas import keys
from api_schemas.redis_scripts import xadd_once
from workers.job.fence import pinned, record_keys
from workers.job.record import bounded, connect, write_caps
from workers.train.sinks import identity

# runner record kind -> stream/SSE event kind
EVENT_KIND = {"epoch": "metric", "teleport": "teleport", "log": "log"}


class RedisSink:
    """``emit`` buffers records; they are written with one script call per batch of ``batch_size``
    records or every ``flush_seconds``, whichever comes first (and on ``close``)."""

    def __init__(self, url: str, job_id: str, batch_size: int = 32, flush_seconds: float = 0.5,
                 maxlen: int = keys.STREAM_MAXLEN, trial: str | None = None, attempt: int | None = None) -> None:
        """``attempt``: the job's attempt its writes are fenced to (default: the one this process pinned)."""
        self.client = connect(url)  # retries through a Redis restart (workers.job.record)
        self.entry_cap, _ = caps = write_caps(self.client, job_id)
        self.attempt = pinned(job_id) if attempt is None else attempt
        self.script = self.client.register_script(xadd_once(caps, self.attempt))
        self.keys = keys.own_keys(job_id) if self.attempt is None else record_keys(self.client, job_id)
        self.job_id = job_id
        self.trial = trial  # a sweep's trial: its events carry "trial" and are deduplicated per trial
        self.batch_size, self.flush_seconds, self.maxlen = batch_size, flush_seconds, maxlen
        self.buffer: list[dict[str, Any]] = []
        self.last_flush = time.monotonic()

    def emit(self, record: dict[str, Any]) -> None:
        if self.trial:
            record = {**record, "trial": self.trial}
        self.buffer.append(record)
        urgent = record.get("kind") in {"epoch", "status", "error", "summary", "start"}  # start: its time is read
        if urgent or len(self.buffer) >= self.batch_size or time.monotonic() - self.last_flush > self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        args: list[Any] = [self.maxlen]
        for record in self.buffer:
            ident = identity(record)
            if ident and self.trial:
                ident = f"{self.trial}/{ident}"
            kind, data = EVENT_KIND.get(str(record.get("kind")), "status"), json.dumps(record, default=float)
            size = len(ident.encode()) + len(kind) + len(data.encode())
            if size > self.entry_cap:
                kind, data = "log", json.dumps(self.too_big(record, size))
            args += [ident, kind, data]
        bounded(lambda: self.script(keys=self.keys, args=args))
        self.buffer.clear()
        self.last_flush = time.monotonic()

    def too_big(self, record: dict[str, Any], size: int) -> dict[str, Any]:
        """The warning written instead of an event over the per-entry cap."""
        out = {"kind": "log", "level": "warning", "time": record.get("time"),
               "message": f"a {record.get('kind')} event of {size} bytes was not written: over the cap of "
                          f"{self.entry_cap} bytes per event (from TLAB_JOB_REDIS_MB)"}
        if self.trial:
            out["trial"] = self.trial
        return out

    def close(self) -> None:
        self.flush()
        self.client.close()


def read_events(url: str, job_id: str) -> list[dict[str, Any]]:
    """Every event of a job's stream, oldest first, as {"id", "kind", "data"} (for tests and tools)."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        entries = client.xrange(keys.events(job_id))
    finally:
        client.close()
    return [{"id": eid, "kind": f["kind"], "data": json.loads(f["data"])} for eid, f in entries]
