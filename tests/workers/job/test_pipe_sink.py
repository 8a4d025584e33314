"""A payload's records through its supervisor (``workers.job.pipe_sink``): each answered once written, in order; a
line that is no JSON object or over the bound dropped with a warning in its place; a write the sink refuses told to
the payload as its message; the payload's ``emit`` never returns before its record was handed on."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from workers.job.orders import Orders
from workers.job.pipe_sink import MAX_LINE, RecordsRefused, records_sink, start_relay
from workers.train.sinks import MemorySink, NullSink


class Full(MemorySink):
    """A sink whose share is full after ``room`` records (as the job's Redis share refuses past its cap)."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room, self.closed = room, False

    def emit(self, record: dict[str, Any]) -> None:
        if len(self.records) >= self.room:
            raise RuntimeError("the job's keys would pass its share of Redis (TLAB_JOB_REDIS_MB=1)")
        super().emit(record)

    def close(self) -> None:
        self.closed = True


def test_records_arrive_in_order_each_before_emit_returns() -> None:
    into = MemorySink()
    theirs, answers, thread = start_relay(into)
    sink = records_sink(Orders("{}", "job", "", "/s", -1, records_fd=theirs, answers_fd=answers))
    for epoch in range(50):
        sink.emit({"kind": "epoch", "epoch": epoch})
        assert into.records[-1] == {"kind": "epoch", "epoch": epoch}  # handed on before emit returned
    sink.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and [r["epoch"] for r in into.records] == list(range(50))


def test_a_line_that_is_no_object_or_too_long_is_dropped_with_a_warning() -> None:
    into = MemorySink()
    theirs, answers, thread = start_relay(into)
    writer, reader = os.fdopen(theirs, "wb", buffering=0), os.fdopen(answers, "rb")

    def send(line: bytes) -> bytes:
        done: list[bytes] = []
        t = threading.Thread(target=lambda: done.append(reader.readline()))
        t.start()
        writer.write(line)
        t.join(timeout=10)
        return done[0]

    assert send(b"[1, 2]\n") == b"ok\n"
    assert send(b"x" * (MAX_LINE + 5) + b"\n") == b"ok\n"
    assert send(b'{"kind": "epoch", "epoch": 0}\n') == b"ok\n"
    writer.close()
    thread.join(timeout=10)
    reader.close()
    kinds = [r["kind"] for r in into.records]
    assert kinds == ["log", "log", "epoch"] and "dropped" in into.records[0]["message"]


def test_a_refused_write_fails_the_payloads_emit_with_its_reason() -> None:
    into = Full(room=2)
    theirs, answers, thread = start_relay(into)
    sink = records_sink(Orders("{}", "job", "", "/s", -1, records_fd=theirs, answers_fd=answers))
    sink.emit({"kind": "epoch", "epoch": 0})
    sink.emit({"kind": "epoch", "epoch": 1})
    with pytest.raises(RecordsRefused, match="TLAB_JOB_REDIS_MB=1"):
        sink.emit({"kind": "epoch", "epoch": 2})
    thread.join(timeout=10)
    assert into.closed and len(into.records) == 2
    sink.close()


def test_a_rank_without_the_pipes_writes_nowhere() -> None:
    assert isinstance(records_sink(Orders("{}", "job", "", "/s", -1, rank=1)), NullSink)


def test_the_runs_hints_are_in_the_ranks_log_too(capfd: pytest.CaptureFixture[str]) -> None:
    """What the payload prints is the rank's log (``tlab logs``): a hint or a budget cut is there, as in a local run."""
    into = MemorySink()
    theirs, answers, thread = start_relay(into)
    sink = records_sink(Orders("{}", "job", "", "/s", -1, records_fd=theirs, answers_fd=answers))
    sink.emit({"kind": "hint", "epoch": 0, "reason": "adaptive_optimizer", "message": "consider teleport.epochs: [0]"})
    sink.emit({"kind": "epoch", "epoch": 0})
    sink.close()
    thread.join(timeout=10)
    assert capfd.readouterr().err.splitlines() == ["hint: consider teleport.epochs: [0]"]
    assert [r["kind"] for r in into.records] == ["hint", "epoch"]
