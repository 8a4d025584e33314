"""A job driver's start-up timeline: the wall-clock time (``time.time()``, seconds) at which this
process first passed each phase, sent as the optional ``startup`` field of the job's ``finished`` status event
(``workers.job.harness.guarded``), where ``benchmarks/service/startup.py`` reads it. A few dict writes per job: free.

Phases, in the order a job passes them (a phase the job's path skips is absent):

- ``spawned``: the operating system's start time of this process (Ray started the job's entrypoint);
- ``driver``: the entrypoint's own code runs (Python started, its light imports done, no torch yet);
- ``ranks``: a gang's other ranks asked of Ray as tasks (after ``ray.init``; several workers only);
- ``torch``: torch and the training loop's modules imported;
- ``group``: a gang's process group formed, every rank joined (``workers.on_ray.gang``; several workers only);
- ``data``: the dataset loaded; ``model``: the model built (``workers.train.build.build_parts``);
- ``checkpoint``: the first checkpoint on disk (``workers.on_ray.driver.DriverContext``; written in the background after
  the first epoch, whose end is the time of the first ``metric`` event).

A job's retry keeps its first try's times. A job trained by a TorchTrainer (``TLAB_IN_DRIVER=0``) has the driver's
phases only: its loop runs in Ray Train's workers.
"""

from __future__ import annotations

import time

PHASES = ("spawned", "driver", "ranks", "torch", "group", "data", "model", "checkpoint")
_marks: dict[str, float] = {}


def begin() -> None:
    """A job starts in this process: forget an earlier job's times (tests run several in one process)."""
    _marks.clear()
    mark("driver")


def mark(phase: str) -> None:
    """This process has passed ``phase`` now (the first time counts)."""
    _marks.setdefault(phase, time.time())


def adopt(times: dict[str, float]) -> None:
    """Another process's phases count as this one's where it has not passed them (a job's sandboxed payload imports
    torch, loads the data and builds the model: ``workers.on_ray.supervisor``); ``spawned`` stays this process's."""
    for phase, at in times.items():
        if phase != "spawned":
            _marks.setdefault(phase, at)


def process_start() -> float | None:
    """When the operating system started this process, as a ``time.time()`` (``None`` where Linux's ``/proc`` is
    not there). From ``/proc/self/stat``'s start time in clock ticks since boot and the boot clock, not psutil's
    ``create_time()``: that adds the boot time in whole seconds, up to 1 s off on a 3-s start-up."""
    import os

    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


def timeline() -> dict[str, float]:
    """The phases passed so far, in ``PHASES`` order, times rounded to the millisecond."""
    marks = {"spawned": process_start(), **_marks}
    return {p: round(marks[p], 3) for p in PHASES if marks.get(p) is not None}
