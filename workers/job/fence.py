"""Fencing: a job's attempt writes to the service's state and storage only while it is the job's current attempt.

The scheduler counts a job's starts in its record (``attempts``, copied into the job's ``run`` hash before each
submit). A process of the job learns its attempt once, at its start, and ``pin``s it; from then on every write it
makes carries it, and the trusted side checks it against the record before the write lands (docs/security.md,
"Fencing"):

- Redis (events, the summary, vitals, trials): the bounded scripts compare the attempt in their text with the record
  in the same atomic step as the write (``api_schemas.redis_scripts``: ``ENDED``);
- files (checkpoints, artifacts): written under a hidden staging name and promoted (renamed) only after ``check``
  passed; the next attempt removes what an earlier one left staged before it writes its own, so a check that passed
  before the record moved is followed by a rename that finds nothing to rename on a shared filesystem;
- the bucket: no upload, and no prune, after a failed ``check`` (``workers.job.bucket.push``).

An attempt that loses the service ends itself: its supervisor's ``Keepalive`` kills its payload once the record says
the attempt ended, or once Redis could not be reached for ``TLAB_ATTEMPT_LEASE_S``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from redis.backoff import ExponentialBackoff, ExponentialWithJitterBackoff
from redis.retry import Retry

from api_schemas import keys
from api_schemas.redis_scripts import ENDED, fence_check

LEASE_ENV = "TLAB_ATTEMPT_LEASE_S"
KEEPALIVE_S = 2.0  # how often a supervisor asks whether its attempt is still the job's


class AttemptEnded(RuntimeError):
    """This attempt of the job has ended (requeued, restarted elsewhere, or the job ended): nothing more of it lands."""


def lease_s() -> float:
    """Seconds without Redis after which an attempt ends itself (``TLAB_ATTEMPT_LEASE_S``, 15)."""
    return float(os.environ.get(LEASE_ENV, "15"))


def record_keys(client: Any, job_id: str) -> list[str]:
    """The KEYS of a fenced write: the job's own keys, and the job hash after them when the job has no ``run`` copy
    (no Redis users of its own: its record is the job hash)."""
    own = keys.own_keys(job_id)
    return own if client.hget(keys.job_run(job_id), keys.JOB_RUN_MARK) is not None else [*own, keys.job(job_id)]


def ended_error(err: redis.ResponseError) -> AttemptEnded | None:
    """The refusal of a fenced script as ``AttemptEnded`` (None: another error)."""
    text = str(err)
    return AttemptEnded(text[text.index(ENDED) + len(ENDED):].strip()) if ENDED in text else None


class Fence:
    """The check of one attempt of one job against its record (``check``), over ``client``."""

    def __init__(self, client: Any, job_id: str, attempt: int) -> None:
        self.client, self.job_id, self.attempt = client, job_id, int(attempt)
        self.keys = record_keys(client, job_id)
        self.script = client.register_script(fence_check(self.attempt))

    def check(self) -> None:
        """Return while this attempt is current; ``AttemptEnded`` once it is not (a Redis error: as raised)."""
        try:
            self.script(keys=self.keys)
        except redis.ResponseError as err:
            raise ended_error(err) or err from None

    def current(self) -> bool:
        """Whether a check passes now: False once the attempt ended, and while Redis cannot be asked."""
        try:
            self.check()
        except (AttemptEnded, redis.RedisError):
            return False
        return True


_pinned: dict[str, tuple[int, str]] = {}  # job id -> (this process's attempt of it, its Redis URL)


def pin(job_id: str, attempt: int, redis_url: str) -> None:
    """This process works for ``attempt`` of ``job_id`` (read once, at its start): its writes carry it."""
    _pinned[job_id] = (int(attempt), redis_url)


def unpin(job_id: str) -> None:
    """This process no longer works for ``job_id`` (a test acting as several attempts in turn)."""
    _pinned.pop(job_id, None)


def pinned(job_id: str) -> int | None:
    """The attempt this process pinned for ``job_id`` (None: none; its writes are not fenced)."""
    pin = pinned_at(job_id)
    return None if pin is None else pin[0]


def pinned_at(job_id: str) -> tuple[int, str] | None:
    """The attempt this process pinned for ``job_id`` and the Redis URL it checks it on (None: none pinned)."""
    return _pinned.get(job_id)


def connect(url: str, **kw: Any) -> redis.Redis:
    """A client that rides out a Redis restart: Redis is back in about a second, but a restarted Redis has lost the
    job's ACL user until the scheduler's next tick makes it again, so a job's writer tries 15 times, waiting a random
    part of 0.1 s doubling to 1 s (up to 12.5 s in all; redis-py's default 10 tries wait up to 5.3 s)."""
    return redis.Redis.from_url(url, retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.1), 15), **kw)


def check(job_id: str) -> None:
    """``Fence.check`` of the pinned attempt of ``job_id`` (nothing when none is pinned); Redis unreachable: raised."""
    if job_id not in _pinned:
        return
    attempt, url = _pinned[job_id]
    client = connect(url)
    try:
        Fence(client, job_id, attempt).check()
    finally:
        client.close()


def still_current(job_id: str, what: str) -> bool:
    """Whether ``check`` passes for the pinned attempt of ``job_id``; when not (it ended, or Redis cannot say), one
    line that ``what`` (``"artifacts not exported"``) is said on stderr."""
    try:
        check(job_id)
    except Exception as err:  # noqa: BLE001 - ended, or Redis unreachable: nothing unchecked is written
        print(f"[tlab] {what}: {' '.join(str(err).split()) or type(err).__name__}", file=sys.stderr, flush=True)
        return False
    return True


class Keepalive:
    """A thread that asks every ``every_s`` whether ``fence``'s attempt is still current and calls ``on_end`` (once,
    with why) when it is not, or when Redis could not be reached for ``lease`` seconds."""

    def __init__(self, fence: Fence, on_end: Callable[[str], None], lease: float | None = None,
                 every_s: float = KEEPALIVE_S) -> None:
        self.fence, self.on_end, self.every_s = fence, on_end, every_s
        self.lease = lease_s() if lease is None else lease
        self.ended = ""  # why the attempt ended ('' while it runs)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="tlab-keepalive", daemon=True)

    def start(self) -> Keepalive:
        self.thread.start()
        return self

    def run(self) -> None:
        last_ok = time.monotonic()
        while not self.done.wait(self.every_s):
            try:
                self.fence.check()
                last_ok = time.monotonic()
                continue
            except AttemptEnded as err:
                self.ended = str(err)
            except redis.RedisError as err:
                if time.monotonic() - last_ok < self.lease:
                    continue
                self.ended = (f"attempt {self.fence.attempt} lost Redis for {self.lease:g} s ({LEASE_ENV}): it ends "
                              f"itself ({type(err).__name__})")
            self.on_end(self.ended)
            return

    def close(self) -> None:
        self.done.set()


# ---- the supervisor's side: a payload's attempt checked, kept alive, its export promoted ----

def attempt_fence(orders: Any) -> Fence | None:
    """The check of the attempt a payload's ``Orders`` carry, on a connection of its own that gives up within
    seconds (the keepalive must notice a lost Redis); None when not fenced."""
    if orders.attempt is None or not orders.redis_url:
        return None
    client = redis.Redis.from_url(orders.redis_url, socket_timeout=5, socket_connect_timeout=5,
                                  retry=Retry(ExponentialBackoff(cap=0.5, base=0.1), 3))
    return Fence(client, orders.job_id, orders.attempt)


def kill_tree(proc: Any, why: str) -> None:
    """SIGKILL to the payload and everything under it: its attempt ended (no grace: a stop would export)."""
    import psutil

    print(f"[tlab] {why}: its training process is killed", file=sys.stderr, flush=True)
    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
    except psutil.Error:
        pass
    proc.kill()


def attempt_ended(fence: Fence | None, keepalive: Keepalive | None) -> str:
    """Why this try's attempt has ended ('' while it has not, or when Redis cannot say)."""
    if keepalive is not None and keepalive.ended:
        return keepalive.ended
    if fence is None:
        return ""
    try:
        fence.check()
    except AttemptEnded as err:
        return str(err)
    except Exception:  # noqa: BLE001 - Redis unreachable: the try's own account stands
        return ""
    return ""


def promote_export(job_id: str, out: Path, attempt: int | None, fence: Fence) -> None:
    """A payload's staged export into ``out`` (the job's ``artifacts/``), once the attempt's check passed."""
    from workers.job.artifacts import promote, staging_dir

    try:
        promote(staging_dir(out, attempt or 0), out, fence.check)
    except AttemptEnded as err:
        print(f"[tlab] artifacts of {job_id} not exported: {err}", file=sys.stderr, flush=True)
    except Exception as err:  # noqa: BLE001 - Redis unreachable: nothing promoted unchecked
        print(f"[tlab] artifacts of {job_id} not exported: the attempt could not be checked "
              f"({' '.join(str(err).split())})", file=sys.stderr, flush=True)


def clear_staged(job_dir: Path, attempt: int | None) -> None:
    """Remove the exports earlier attempts left staged (rank 0's ``DriverContext.drop_partial`` does the same for
    half-written checkpoints): run after the record moved to this attempt, so a promotion an ended attempt checked
    before the record moved finds nothing left to rename on a shared filesystem."""
    from workers.job.artifacts import remove_staged

    for old in job_dir.glob(".export-*"):
        if attempt is None or old.name != f".export-{attempt}":
            remove_staged(old)
