"""A job whose driver died without a word: told apart from the job's own failure, said in one line, retried.

Ray reports such a Ray job FAILED with the driver's exit status: ``-9`` when a signal ended the process itself
(``128 + 9`` through a shell). A job that failed by itself said why first (an error event, a line marked
``TLAB-FAILURE:``: its code raised, its loss diverged, its preflight failed): that is never retried, as a retry
would only repeat it. A death by a signal is (``kill -9``, the kernel's OOM killer, a crash in native code): the
job goes back to the queue and resumes from its last checkpoint, up to ``resources.max_retries`` times over all
its attempts (``TLAB_MAX_ATTEMPTS`` caps them for the cluster), each epoch still reported once. The line says what
happened and what was done::

    driver killed by SIGKILL at epoch 11 (out of memory? peak RSS 3.2 GB); retrying from epoch 10, attempt 2 of 3

The OOM killer is named where the OS says so (``oom_verdict``): the kernel's log names the driver's pid, or its
memory cgroup's ``oom_kill`` counter grew since the driver started (``api_schemas.vitals``); then the line
suggests ``resources.memory_gb``, which the scheduler reserves in Ray.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
from pathlib import Path

from api_schemas import keys
from api_schemas.jobs import JobState
from api_schemas.reasons import ENDED_EXIT, killed_by, one_line
from api_schemas.vitals import CGROUP_ROOT, OOM_FILES, VITALS_FIELD, DriverVitals, oom_kills
from service.core.settings import Settings
from service.core.store import Store
from service.scheduler.preempt import failed_attempts

log = logging.getLogger("tlab.scheduler")
ACTIVE = [JobState.STARTING, JobState.RUNNING]


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def vitals_of(store: Store, job_id: str) -> DriverVitals | None:
    """What the driver last wrote of itself (its run copy, else the job hash when jobs are not isolated)."""
    raw = store.r.hget(keys.job_run(job_id), VITALS_FIELD) or store.r.hget(keys.job(job_id), VITALS_FIELD)
    try:
        return DriverVitals.model_validate_json(raw) if raw else None
    except ValueError:
        return None


def this_boot() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def kernel_says_oom(pid: int) -> bool:
    """The kernel's log names ``pid`` as the OOM killer's victim (``dmesg``, where this process may read it)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any("Killed process" in line and f"process {pid} " in line for line in out.splitlines())


def cgroup_counted_oom(v: DriverVitals, root: str = CGROUP_ROOT) -> bool:
    """The driver's memory cgroup counted an OOM kill since it started (only a cgroup file under ``root`` is ever
    read: the job names it)."""
    path = Path(v.oom_file)
    if v.oom_kills is None or path.name not in OOM_FILES or not path.resolve().is_relative_to(root):
        return False
    try:
        now = oom_kills(path.read_text())
    except OSError:
        return False
    return now is not None and now > v.oom_kills


def oom_verdict(v: DriverVitals | None) -> bool | None:
    """True: the OS says the OOM killer ended the driver; False: it says nothing of it; None: it cannot tell (the
    driver ran on another machine, or said nothing of itself)."""
    if v is None or not v.boot_id or v.boot_id != this_boot():
        return None
    return kernel_says_oom(v.pid) or cgroup_counted_oom(v)


def gb(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.1f} GB"


def death_line(signum: int, epoch: int | None, vitals: DriverVitals | None, oom: bool | None) -> str:
    """``driver killed by SIGKILL at epoch 11 (out of memory? peak RSS 3.2 GB)``: what happened, as far as known."""
    at = f" at epoch {epoch}" if epoch else " before its first epoch"
    rss = vitals.peak_rss_bytes if vitals else 0
    peak = f"peak RSS {gb(rss)}" if rss else "peak RSS not known"
    if signum != signal.SIGKILL:
        note = ""
    elif oom:
        ask = math.ceil(rss * 1.5 / 2**30) if rss else None
        hint = f"set resources.memory_gb to {ask} or more" if ask else "set resources.memory_gb"
        note = f" (out of memory: the kernel's OOM killer ended it, {peak}; {hint})"
    else:
        note = f" (out of memory? {peak})"
    return f"driver killed by {signal_name(signum)}{at}{note}"


def retries_allowed(settings: Settings, data: dict[str, str]) -> int:
    """The job's ``resources.max_retries`` (a sweep's: its base spec's), capped by ``TLAB_MAX_ATTEMPTS - 1``."""
    try:
        asked = int(json.loads(data.get("spec") or "{}").get("resources", {}).get("max_retries", 2))
    except (ValueError, TypeError, AttributeError):
        asked = 2
    return max(0, min(asked, settings.max_attempts - 1))


def can_retry(settings: Settings, data: dict[str, str]) -> bool:
    """Another attempt is allowed: the attempts that failed so far (this one too) are at most the retries + 1."""
    return failed_attempts(data) <= retries_allowed(settings, data)


def died(store: Store, settings: Settings, data: dict[str, str], exit_code: int | None, now: float) -> bool:
    """A driver ended by a signal without a word, or one that ended itself having lost Redis (``ENDED_EXIT``):
    retried or failed, saying so (module doc). False for a driver that exited by itself otherwise."""
    if exit_code == ENDED_EXIT:  # the attempt ended itself without a word: it lost Redis (workers.job.fence)
        what = "the job's driver ended itself: it could not reach the service's Redis for TLAB_ATTEMPT_LEASE_S"
        retry_or_fail(store, settings, data, what, now)
        return True
    signum = killed_by(exit_code)
    if signum is None:
        return False
    vitals = vitals_of(store, data["id"])
    oom = oom_verdict(vitals) if signum == signal.SIGKILL else None
    what = death_line(signum, store.progress(data["id"], data).epoch, vitals, oom)
    log.info("%s: %s", data["id"], what)
    retry_or_fail(store, settings, data, what, now)
    return True


def resume_epoch(settings: Settings, job_id: str) -> int | None:
    """The epochs of the newest checkpoint a retry goes on from (None: none kept)."""
    from service.core.checkpoints import kept_epochs

    try:
        return max(kept_epochs(settings, job_id), default=None)
    except OSError:
        return None


def retry_or_fail(store: Store, settings: Settings, data: dict[str, str], what: str, now: float) -> bool:
    """Queue the job again to resume from its last checkpoint, or fail it when its retries are used up; ``what``
    says what happened. True if it was queued again."""
    job_id, allowed = data["id"], retries_allowed(settings, data)
    if can_retry(settings, data):
        epoch = resume_epoch(settings, job_id)
        where = f"epoch {epoch}" if epoch else "its start"
        line = one_line(f"{what}; retrying from {where}, attempt {failed_attempts(data) + 1} of {allowed + 1}")
        store.log_event(job_id, "warning", line, now)
        return store.transition(job_id, JobState.QUEUED, expect=ACTIVE, now=now, reason=line)
    line = one_line(f"{what}; not retried: {failed_attempts(data)} attempts failed (resources.max_retries={allowed})")
    store.transition(job_id, JobState.FAILED, expect=ACTIVE, now=now, reason=line, failure_reason=line)
    return False
