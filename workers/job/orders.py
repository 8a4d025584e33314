"""What a payload (``workers.payload``, one try of a job's training in its sandbox) is told by its supervisor
(``workers.on_ray.supervisor``), and what it answers: its ``Orders`` in on stdin, its ``Outcome`` out as JSON, after
a word that it started (``say_started``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

STARTED = "started\n"  # a payload's first words on its result descriptor: it runs and has read its orders


def say_started(result_fd: int) -> None:
    """Tell the supervisor this payload started: one that ends unreported after this crashed (a retry may get
    through); one that ends without it never got to run, and a retry would meet the same (``split_result``)."""
    os.write(result_fd, STARTED.encode())


def split_result(raw: str) -> tuple[bool, str]:
    """What a payload wrote on its result descriptor: whether it started, and its ``Outcome`` as JSON ('' if none)."""
    return raw.startswith(STARTED), raw.removeprefix(STARTED)


@dataclass
class Orders:
    """What a payload is told: its job, its rank, where its gang meets, what it starts from."""

    spec: str  # the ExperimentSpec as JSON
    job_id: str
    redis_url: str  # the job's own Redis user: the supervisor's only ('' in the payload's copy: ``records_fd``)
    storage: str
    result_fd: int
    artifacts: str | None = None
    start_from: str | None = None
    rank: int = 0
    host: str = ""
    port: int = 0
    listen_fd: int | None = None  # rank 0 of a gang: the socket its TCP store serves on
    kind: str = "train"  # or "preflight" (``workers.job.preflight_check``: it writes its own verdict), or "trial":
    trial: str | None = None  # a sweep's trial (``workers.on_ray.trial_bridge``): its id, its scratch directory, and
    scratch: str = ""  # the pipes its reports to Tune go out on and are answered on
    report_fd: int | None = None
    answer_fd: int | None = None
    records_fd: int | None = None  # rank 0: where its records go, one JSON line each (``workers.job.pipe_sink``),
    answers_fd: int | None = None  # and where each is answered once written
    sweep: str | None = None  # a preflight of a sweep: the sweep as JSON (its first point is what is tried)
    attempt: int | None = None  # the job's attempt this try belongs to (``workers.job.fence``); None: not fenced


@dataclass
class Outcome:
    """How a try ended: ``summary`` if it trained; else the one-line ``error``, whether a retry from the last
    checkpoint is worth it, and whether it was a stop."""

    summary: dict[str, Any] | None = None
    error: str = ""
    retried: bool = False
    stopped: bool = False
    startup: dict[str, float] = field(default_factory=dict)
    ended: bool = False  # the job's attempt ended under it (``workers.job.fence``): no retry, nothing more written


class Stopped(Exception):
    """A try being stopped — a SIGTERM (cancel, time limit, preemption), or a trial whose supervisor is gone (Tune
    ended the trial): the payload ends it as a stop, without a traceback."""
