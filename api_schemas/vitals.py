"""What a job's driver says about itself while it runs, for the scheduler to explain its death.

A driver that the kernel kills (``kill -9``, the OOM killer) says nothing on its way out; it writes these every few
seconds into its run copy (``keys.job_run``, field ``VITALS_FIELD``; ``workers.job.vitals``), and the scheduler reads
them once Ray reports the driver gone without a word (``service.scheduler.deaths``): which process it was, on which boot
of which machine, how much memory it held at most, and its memory cgroup's OOM-kill counter at its start.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

VITALS_FIELD = "vitals"
CGROUP_ROOT = "/sys/fs/cgroup"
OOM_FILES = ("memory.events", "memory.oom_control")  # cgroup v2, v1: each has a line ``oom_kill <count>``


class DriverVitals(BaseModel):
    """The driver's own account of itself (written by the job: read as untrusted input)."""

    model_config = ConfigDict(extra="ignore")

    pid: int = Field(ge=0)
    boot_id: str = Field("", max_length=64, description="/proc/sys/kernel/random/boot_id of its machine")
    peak_rss_bytes: int = Field(0, ge=0, description="its largest resident set so far (getrusage ru_maxrss)")
    oom_file: str = Field("", max_length=4096, description="its memory cgroup's OOM counter file, if readable")
    oom_kills: int | None = Field(None, ge=0, description="that counter at the driver's start")


def oom_kills(text: str) -> int | None:
    """The ``oom_kill`` count in a cgroup's ``memory.events`` (v2) or ``memory.oom_control`` (v1).

    >>> oom_kills("oom_kill_disable 0\\nunder_oom 0\\noom_kill 3\\n")
    3
    """
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None
