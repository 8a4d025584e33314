"""A payload's records reach Redis through its supervisor: the payload holds no Redis login at all.

The payload (the user's code beside ours, in the sandbox) writes each record as one JSON line on a pipe
(``PipeSink``); its supervisor, on the trusted side, reads them within bounds and hands each to the job's
``RedisSink`` (``relay_records``), whose writes go through the bounded scripts the service loaded. So whatever the
job's code does, what lands in Redis is what the supervisor wrote: no raw ``XADD`` or ``HSET`` of the job's own,
no key of its choosing, no write past its caps. A line over ``MAX_LINE`` bytes, or one that is not a JSON object,
is dropped and said in the job's stream as a warning; the payload blocks while the supervisor catches up (the pipe
is the back-pressure).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from workers.train.sinks import MetricSink

MAX_LINE = 1 << 20  # bytes of one record as JSON (the job's per-event cap in Redis is at most this too)


class PipeSink:
    """The payload's side: each record one line on ``fd`` (its supervisor's pipe)."""

    def __init__(self, fd: int) -> None:
        self.out = os.fdopen(fd, "wb", buffering=0)
        self.lock = threading.Lock()  # (the loop and a logging thread may both emit)

    def emit(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, default=float) + "\n").encode()
        with self.lock:
            self.out.write(line)

    def close(self) -> None:
        with self.lock:
            if not self.out.closed:
                self.out.close()


def relay_records(fd: int, sink: MetricSink) -> None:
    """The supervisor's side: every line on ``fd`` until its end, each a record for ``sink``; then ``sink`` closed."""
    with os.fdopen(fd, "rb") as lines:
        try:
            while line := lines.readline(MAX_LINE + 1):
                record = _record(line)
                if record is None:
                    while line and not line.endswith(b"\n"):  # the rest of an oversized line
                        line = lines.readline(MAX_LINE + 1)
                    sink.emit({"kind": "log", "level": "warning", "message": "a record from the training process "
                               f"was dropped: not one JSON object within {MAX_LINE} bytes"})
                    continue
                sink.emit(record)
        finally:
            sink.close()


def _record(line: bytes) -> dict[str, Any] | None:
    if len(line) > MAX_LINE:
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def start_relay(sink: MetricSink) -> tuple[int, threading.Thread]:
    """A pipe whose write end goes to the payload (``Orders.events_fd``) and a thread relaying its read end."""
    read, write = os.pipe()
    thread = threading.Thread(target=relay_records, args=(read, sink), name="records", daemon=True)
    thread.start()
    return write, thread
