"""A payload's host memory, held to ``resources.memory_gb`` by its supervisor (``workers.on_ray.supervisor``).

Ray reserves ``memory_gb`` on the node but never enforces it: a job that reserved 2 GiB and took 20 left the node's
OOM killer to choose a victim among its neighbours. The supervisor, outside the sandbox, reads the payload's
processes (bwrap, the payload, its DataLoader workers) from a thread every ``every_s`` (0.2 s) and kills them at
once when they hold more than the job asked for; the job ends failed, not retried, saying what it held and what to
set. A reading is the processes' resident sets summed (one ``/proc`` read each, microseconds), confirmed over the
limit by their proportional sets (``smaps_rollup``, milliseconds: a page shared between them, such as a forked
DataLoader worker's, counted once) before anything is killed. Between two readings a payload can allocate faster
than it is read; for that, and for jobs without ``memory_gb``, each payload starts with ``oom_score_adj`` 1000, so
the kernel's OOM killer takes a payload before any process of the service (Redis, the Ray head, the API, the
scheduler, a job's supervisor); a payload may undo that, to 0, never put itself below them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import psutil

from api_schemas.spec import GIB
from workers.job.vitals import descendants

OOM_SCORE_ADJ = "1000"  # the most a process can be preferred by the OOM killer; raising it needs no privilege


def first_to_go() -> None:
    """In the payload's process before it starts (a ``preexec_fn``): the kernel's first OOM victim, it and every
    process it starts. It may take itself back to 0 (the service's processes' score), never below: that needs
    CAP_SYS_RESOURCE, which the sandbox drops."""
    try:
        Path("/proc/self/oom_score_adj").write_text(OOM_SCORE_ADJ)
    except OSError:
        pass  # no /proc (not Linux): nothing to prefer


def processes(pid: int) -> list[psutil.Process]:
    """``pid`` and its descendants, found from its own ``/proc`` entries (psutil's ``children`` reads every process
    of the node: ~1.6 ms for 77 here, far more on a busy node, 5 times a second)."""
    out = []
    for p in [pid, *descendants(pid)]:
        try:
            out.append(psutil.Process(p))
        except psutil.Error:
            continue  # ended (the payload itself too: then none)
    return out


def kill(procs: list[psutil.Process]) -> None:
    """SIGKILL to each, children first (they may hold the most): a checkpoint written now would need more memory."""
    for proc in reversed(procs):
        try:
            proc.kill()
        except psutil.Error:
            pass


def resident(procs: list[psutil.Process]) -> int:
    """The resident sets summed: at least what the processes hold (shared pages counted in each)."""
    return sum(_read(p, lambda q: q.memory_info().rss) for p in procs)


def proportional(procs: list[psutil.Process]) -> int:
    """The proportional sets summed: what the processes hold, a page shared by k of them counted 1/k in each. A
    process whose ``smaps_rollup`` its supervisor may not read (a supervisor that is not root, a payload the kernel
    made undumpable) counts its resident set: over, never under, what it holds."""
    return sum(_read(p, _pss) for p in procs)


def _pss(proc: psutil.Process) -> int:
    try:
        return proc.memory_full_info().pss
    except (psutil.AccessDenied, AttributeError):
        return proc.memory_info().rss


def _read(proc: psutil.Process, how: Callable[[psutil.Process], int]) -> int:
    try:
        return int(how(proc))
    except psutil.Error:
        return 0  # gone: nothing counted


class MemoryLimit:
    """Watches a payload from a thread of its own (``start``): when its processes hold more than ``memory_gb``, it
    kills them and keeps the job's failure, one line, in ``error``; ``close`` ends the watch."""

    def __init__(self, memory_gb: float | None, every_s: float = 0.2) -> None:
        self.memory_gb, self.every_s = memory_gb, every_s
        self.limit = int(memory_gb * GIB) if memory_gb else None
        self.error, self.done = "", threading.Event()

    def start(self, pid: int) -> MemoryLimit:
        if self.limit is not None:
            threading.Thread(target=self.watch, args=(pid,), name="tlab-memory-limit", daemon=True).start()
        return self

    def close(self) -> None:
        self.done.set()

    def watch(self, pid: int) -> None:
        while not self.done.wait(self.every_s):
            procs = processes(pid)
            if not procs:
                return
            self.error = self.over(procs)
            if self.error:
                kill(procs)
                return

    def over(self, procs: list[psutil.Process]) -> str:
        """'' while ``procs`` hold at most ``memory_gb``; else why they are stopped."""
        assert self.limit is not None
        if resident(procs) <= self.limit:
            return ""
        held = proportional(procs)
        if held <= self.limit:
            return ""
        return (f"the training held {held / GIB:.2f} GiB of host memory, over resources.memory_gb="
                f"{self.memory_gb:g}: raise resources.memory_gb, or lower training.batch_size (raise "
                f"training.grad_accumulation to keep the step's batch)")
