"""Reading the logs a job's processes keep in storage (``workers.job.logs`` writes them): a tail, and a follow.

Files: ``$TLAB_STORAGE/<job>/logs/attempt-<n>/driver.log`` (the Ray job's entrypoint; a 1-worker job trains
there, so it is also rank 0's) and ``rank-<r>.log`` (Ray Train workers). They are plain files on the storage
every node shares, so they are readable after Ray has forgotten the job and after a cluster restart.

A follow is Server-Sent Events whose ``id`` is ``<attempt>:<byte offset>``: a reconnect with ``Last-Event-ID``
goes on from that byte. It moves on to the next attempt's file when the job is started again (a requeue after a
preemption or a lost cluster), and ends with an ``end`` event once the job has ended and its file is read.

A job writes these files: each is opened without following a link (``service.core.safe_files``); a link or a special
file where a log should be is refused with one line (404), and a follow treats it as empty.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import BinaryIO

from service.core import safe_files
from service.core.errors import InvalidInput, JobNotFound

CHUNK = 64 * 1024  # bytes per SSE event at most
MAX_READ = 64 << 20  # a whole log is its last 64 MiB at most (workers cap theirs at TLAB_MAX_LOG_MB, 20 by default)
POLL_S = 0.5  # how often a follow looks for new bytes
REFRESH_S = 2.0  # with a bucket as storage: how often a follow pulls what other hosts uploaded
_ATTEMPT = re.compile(r"attempt-(\d+)")
_CURSOR = re.compile(r"(\d+):(\d+)")
_ALIAS = re.compile(r"(driver|preflight|trial-[0-9a-z_]{1,40})\.log")


def root(storage: str | Path, job_id: str) -> Path:
    return Path(storage) / job_id / "logs"


def attempts(storage: str | Path, job_id: str) -> list[int]:
    base = root(storage, job_id)
    if not base.is_dir():
        return []
    return sorted(int(m.group(1)) for d in base.iterdir() if (m := _ATTEMPT.fullmatch(d.name)) and d.is_dir())


def file_of(storage: str | Path, job_id: str, rank: str, attempt: int) -> Path:
    """The log file of ``rank`` (a number, ``driver``, ``preflight`` or ``trial-<id>``) in ``attempt``; rank 0 of
    an attempt without a rank-0 file (it failed before training) is the driver's, or the preflight's (it failed
    there)."""
    folder = root(storage, job_id) / f"attempt-{attempt}"
    if rank in ("driver", "preflight") or rank.startswith("trial-"):
        return folder / f"{rank}.log"
    path = folder / f"rank-{rank}.log"
    if path.exists() or rank != "0":
        return path
    driver = folder / "driver.log"  # a job that failed its preflight has only that one's log
    return driver if driver.exists() or not (folder / "preflight.log").exists() else folder / "preflight.log"


def pick_attempt(storage: str | Path, job_id: str, attempt: int | None) -> int | None:
    """``attempt`` if it has logs (a 404 listing those that do if not); the newest when None; None: no logs."""
    have = attempts(storage, job_id)
    if attempt is None:
        return have[-1] if have else None
    if attempt not in have:
        listed = ", ".join(map(str, have)) or "none yet"
        raise JobNotFound(f"attempt {attempt} kept no logs (attempts with logs: {listed})", field="attempt")
    return attempt


def open_log(storage: str | Path, path: Path) -> BinaryIO | None:
    """The log file ``path`` under ``storage``, opened without following a link (``service.core.safe_files``: a link or
    special file is ``UnsafeFile``); None if there is none. The one link followed is a 1-worker job's ``rank-0.log``
    naming a log beside it (``workers.job.logs.also_as``), opened the same way."""
    rel = path.relative_to(storage)
    try:
        return os.fdopen(safe_files.open_file(storage, rel.as_posix()), "rb")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except safe_files.UnsafeFile:
        target = alias_of(path)
        if target is None:
            raise
        return open_log(storage, path.with_name(target))


def alias_of(path: Path) -> str | None:
    """The sibling a rank's log links to, when it is nothing but the name of a driver's, preflight's or trial's log."""
    try:
        target = os.readlink(path)
    except OSError:
        return None
    return target if _ALIAS.fullmatch(target) and path.name.startswith("rank-") else None


def tail(storage: str | Path, path: Path, lines: int | None) -> str:
    """The file's last ``lines`` lines (all when None), of its last ``MAX_READ`` bytes at most; reads only as much
    of the end as it needs."""
    f = open_log(storage, path)
    if f is None:
        return ""
    with f:
        size = f.seek(0, 2)
        if lines is None:
            f.seek(max(0, size - MAX_READ))
            return f.read(MAX_READ).decode(errors="replace")
        block, data = 8192, b""
        while data.count(b"\n") <= lines and len(data) < min(size, MAX_READ):
            block = min(block * 2, size, MAX_READ)
            f.seek(size - block)
            data = f.read(block)
    kept = data.splitlines(keepends=True)[-lines:] if lines else []
    return b"".join(kept).decode(errors="replace")


def parse_cursor(last_event_id: str | None) -> tuple[int, int] | None:
    if last_event_id is None:
        return None
    m = _CURSOR.fullmatch(last_event_id)
    if not m:
        raise InvalidInput("Last-Event-ID of a log stream is <attempt>:<offset>, like 1:2048", field="Last-Event-ID")
    return int(m.group(1)), int(m.group(2))


def sse_chunk(attempt: int, offset: int, data: bytes) -> str:
    lines = data.decode(errors="replace").split("\n")
    return f"id: {attempt}:{offset}\nevent: log\n" + "".join(f"data: {line}\n" for line in lines) + "\n"


class _Follow:
    """Where a follow stands: the attempt and the byte offset of the next unsent byte."""

    def __init__(self, storage: str | Path, job_id: str, rank: str, cursor: tuple[int, int] | None) -> None:
        self.storage, self.job_id, self.rank = storage, job_id, rank
        self.attempt, self.offset = cursor if cursor else (0, 0)
        self.chosen: tuple[int, Path] | None = None

    def path(self, over: bool) -> Path | None:
        """The attempt's file, chosen once and kept (the offset must never jump files): ``file_of``'s, except that
        rank 0 waits for its own file (a multi-worker job's appears after the driver's; a 1-worker job's driver
        links it to its own) and reads the driver's only once the attempt is ``over`` without one."""
        if not self.attempt:
            return None
        if self.chosen is None or self.chosen[0] != self.attempt:
            path = file_of(self.storage, self.job_id, self.rank, self.attempt)
            if not path.exists() or (self.rank == "0" and path.name in ("driver.log", "preflight.log") and not over):
                return None
            self.chosen = (self.attempt, path)
        return self.chosen[1]

    def read(self, ended: bool) -> tuple[str | None, bool]:
        """(an event with what is new, or None; whether there is nothing more to wait for in this attempt)."""
        newer = [a for a in attempts(self.storage, self.job_id) if a > self.attempt]
        done = bool(newer) or ended  # nothing more will be written to this attempt's file
        path = self.path(done)
        data = b""
        try:
            f = open_log(self.storage, path) if path is not None else None
        except safe_files.UnsafeFile:  # said in the API's log; the follow sees an empty file
            f = None
        if f is not None:
            with f:
                f.seek(self.offset)
                data = f.read(CHUNK)
        cut = data.rfind(b"\n") + 1
        if cut and (not done or len(data) == CHUNK):
            data = data[:cut]  # whole lines: a partial last line waits for its end while the job writes
        elif not done and len(data) < CHUNK:
            data = b""
        if data:
            start, self.offset = self.offset, self.offset + len(data)
            return sse_chunk(self.attempt, start, data[:-1] if data.endswith(b"\n") else data), False
        if newer:
            self.attempt, self.offset = newer[0], 0
            return None, False
        return None, ended


async def follow(storage: str | Path, job_id: str, rank: str, cursor: tuple[int, int] | None,
                 ended: Callable[[], Awaitable[bool]], still_valid: Callable[[], Awaitable[bool]],
                 heartbeat_s: float, refresh: Callable[[], None] | None = None) -> AsyncIterator[str]:
    """SSE text: the rank's log from ``cursor`` (the start when None), then what is written, until the job has
    ended and its last file is read (``end``), or the caller's token stops signing in. ``refresh`` (with a bucket
    as storage: pull what the job's other hosts uploaded) runs every ``REFRESH_S`` and once the job has ended."""
    state = _Follow(storage, job_id, rank, cursor)
    yield "retry: 2000\n\n"
    quiet, synced, final = 0.0, -REFRESH_S, False
    while True:
        is_ended = await ended()  # before the read: bytes written before the end are read after it
        if refresh is not None and ((is_ended and not final) or time.monotonic() - synced >= REFRESH_S):
            final, synced = final or is_ended, time.monotonic()
            await asyncio.to_thread(refresh)
        event, finished = await asyncio.to_thread(state.read, is_ended)
        if event:
            quiet = 0.0
            yield event
            continue
        if finished:
            yield "event: end\ndata: {}\n\n"
            return
        if not await still_valid():
            return
        await asyncio.sleep(POLL_S)
        quiet += POLL_S
        if quiet >= heartbeat_s:
            quiet = 0.0
            yield ": keep-alive\n\n"
