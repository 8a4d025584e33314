"""A payload's records reach Redis through its supervisor: the payload holds no Redis login at all.

The payload (the user's code beside ours, in the sandbox) writes each record as one JSON line on a pipe
(``PipeSink``) and waits for its supervisor's answer on another; the supervisor, on the trusted side, reads the line
within bounds, hands the record to the job's ``RedisSink`` (``relay_records``), whose writes go through the bounded
scripts the service loaded, and answers. So what lands in Redis is what the supervisor wrote (no raw ``XADD`` or
``HSET`` of the job's own, no key of its choosing, no write past its caps), and a record is as far when ``emit``
returns as it was when the payload wrote to Redis itself: an epoch's metrics are in the stream before its checkpoint
is written, so a stop or a lost node loses none.

A record ``{"kind": "fence"}`` is no event: the supervisor answers it once it checked that the job's attempt is still
current (``PipeSink.check``, before a checkpoint is renamed into place: ``workers.job.fence``).

A line over ``MAX_LINE`` bytes, or one that is not a JSON object, is dropped and said in the job's stream as a
warning. A write the job's share refuses (``ShareFull``) is answered with its message, and the payload's ``emit``
raises it: the job stops, saying why, as before.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

from workers.job.orders import Orders
from workers.train.sinks import MetricSink, NullSink, SaySink

MAX_LINE = 1 << 20  # bytes of one record as JSON (the job's per-event cap in Redis is at most this too)
OK = b"ok\n"
SAY = SaySink()
FENCE = "fence"  # a record's kind that asks the supervisor to check the attempt (``PipeSink.check``)


class RecordsRefused(RuntimeError):
    """The supervisor could not write a record (the job's share of Redis is full, say): one line."""


class PipeSink:
    """The payload's side: each record one line on ``fd``, answered on ``answers`` (its supervisor's pipes)."""

    def __init__(self, fd: int, answers: int) -> None:
        self.out = os.fdopen(fd, "wb", buffering=0)
        self.answers = os.fdopen(answers, "rb")
        self.lock = threading.Lock()  # (the loop and a logging thread may both emit)

    def emit(self, record: dict[str, Any]) -> None:
        SAY.emit(record)  # the run's hints and budget cuts in the rank's log too, as a local run prints them
        line = (json.dumps(record, default=float) + "\n").encode()
        with self.lock:
            self.out.write(line)
            said = self.answers.readline()
        if said != OK:
            raise RecordsRefused(said.decode(errors="replace").strip() or "the supervisor stopped taking records")

    def check(self) -> None:
        """Return once the supervisor said this job's attempt is still its current one; ``RecordsRefused`` (with
        why) once it is not, or once the supervisor stopped answering."""
        if self.out.closed:
            raise RecordsRefused("the records pipe is closed: the attempt cannot be checked")
        self.emit({"kind": FENCE})

    def close(self) -> None:
        with self.lock:
            for f in (self.out, self.answers):
                if not f.closed:
                    f.close()


def records_sink(orders: Orders) -> MetricSink:
    """Where a payload's records go: its supervisor's pipe (rank 0), or nowhere (another rank of a gang)."""
    if orders.records_fd is None or orders.answers_fd is None:
        return NullSink()
    return PipeSink(orders.records_fd, orders.answers_fd)


def relay_records(fd: int, answers: int, sink: MetricSink, fence: Callable[[], None] | None = None) -> None:
    """The supervisor's side: every line on ``fd`` until its end, each a record for ``sink`` (or, ``{"kind":
    "fence"}``, a call of ``fence``), answered on ``answers``; then ``sink`` closed. A write ``sink`` refuses (or a
    check ``fence`` fails) is answered with its message and ends the relay."""
    with os.fdopen(fd, "rb") as lines, os.fdopen(answers, "wb", buffering=0) as out:
        try:
            while line := lines.readline(MAX_LINE + 1):
                record = _record(line)
                if record is None:
                    while line and not line.endswith(b"\n"):  # the rest of an oversized line
                        line = lines.readline(MAX_LINE + 1)
                    record = {"kind": "log", "level": "warning", "message": "a record from the training process was "
                              f"dropped: not one JSON object within {MAX_LINE} bytes"}
                try:
                    if record.get("kind") != FENCE:
                        sink.emit(record)
                    elif fence is not None:
                        fence()
                except Exception as err:  # noqa: BLE001 - the job's share full, Redis gone: the payload is told
                    _answer(out, (" ".join(str(err).split()) or type(err).__name__).encode()[:4000] + b"\n")
                    return
                _answer(out, OK)
        finally:
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001 - its last batch not written: said in the job's log
                print(f"the job's last records were not written: {err}", flush=True)


def _answer(out: Any, said: bytes) -> None:
    try:
        out.write(said)
    except BrokenPipeError:  # the payload is gone: what it sent is written all the same
        pass


def _record(line: bytes) -> dict[str, Any] | None:
    if len(line) > MAX_LINE:
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def start_relay(sink: MetricSink, fence: Callable[[], None] | None = None) -> tuple[int, int, threading.Thread]:
    """The payload's two ends (records out, answers in) and a thread relaying them to ``sink`` (``fence``: the
    attempt's check)."""
    lines, theirs = os.pipe()
    mine, answers = os.pipe()
    thread = threading.Thread(target=relay_records, args=(lines, answers, sink, fence), name="records", daemon=True)
    thread.start()
    return theirs, mine, thread
