"""The driver's vitals (``api_schemas.vitals``), written every few seconds from a thread of its own.

The kernel's OOM killer sends SIGKILL: no handler runs, so what the scheduler needs to say why the driver died
(its peak RSS, its cgroup's OOM counter before) must already be in Redis. One small HSET when the peak grew.
"""

from __future__ import annotations

import os
import resource
import threading
from pathlib import Path

import redis

from api_schemas.vitals import CGROUP_ROOT, VITALS_FIELD, DriverVitals, oom_kills
from workers.job.fence import AttemptEnded
from workers.job.record import connect, write_field

EVERY_S = 2.0


def descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on (``/proc/<pid>/task/*/children``; [] where there is no /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids = [int(k) for k in task.read_text().split()]
        except (OSError, ValueError):
            continue
        for kid in kids:
            out += [kid, *descendants(kid)]
    return out


def vm_hwm(pid: int) -> int:
    """A process's own peak resident set (``VmHWM``), in bytes; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set plus its descendants' (the training may run in a sandboxed child): what
    the OOM killer weighs, as an upper bound."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB
    return own + sum(vm_hwm(kid) for kid in descendants(os.getpid()))


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def oom_file(cgroups: str | None = None) -> str:
    """This process's memory cgroup's OOM counter file (v2 ``memory.events``, v1 ``memory.oom_control``), ''
    when none is readable."""
    try:
        cgroups = Path("/proc/self/cgroup").read_text() if cgroups is None else cgroups
    except OSError:
        return ""
    for line in cgroups.splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0":
            candidate = Path(CGROUP_ROOT + path) / "memory.events"
        elif "memory" in controllers.split(","):
            candidate = Path(CGROUP_ROOT, "memory", path.lstrip("/")) / "memory.oom_control"
        else:
            continue
        if candidate.is_file():
            return str(candidate)
    return ""


def current(start: DriverVitals | None = None) -> DriverVitals:
    """The vitals now; the OOM counter as of ``start`` (the driver's first reading) when given."""
    if start is not None:  # a child that ended takes its peak with it: the largest seen is kept
        return start.model_copy(update={"peak_rss_bytes": max(start.peak_rss_bytes, peak_rss_bytes())})
    path = oom_file()
    try:
        kills = oom_kills(Path(path).read_text()) if path else None
    except OSError:
        kills = None
    return DriverVitals(pid=os.getpid(), boot_id=boot_id(), peak_rss_bytes=peak_rss_bytes(), oom_file=path,
                        oom_kills=kills)


def watch(redis_url: str, job_id: str, every_s: float = EVERY_S) -> threading.Event:
    """Write the vitals now and whenever the peak RSS grew, every ``every_s`` (a daemon thread), until the
    returned event is set."""
    start, done = current(), threading.Event()

    def loop() -> None:
        client, written, now = connect(redis_url, decode_responses=True), -1, start
        while not done.is_set():
            now = current(now)
            if now.peak_rss_bytes != written:
                try:
                    write_field(client, job_id, VITALS_FIELD, now.model_dump_json())
                    written = now.peak_rss_bytes
                except redis.RedisError:
                    pass  # Redis restarting: the next round writes them
                except AttemptEnded:  # this attempt is over (``workers.job.fence``): nothing more to say
                    break
            done.wait(every_s)
        client.close()

    threading.Thread(target=loop, name="tlab-vitals", daemon=True).start()
    return done
