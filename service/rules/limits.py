"""Time and storage limits: what a job may ask for at submit, and what the scheduler does at the limit.

A job's limit is ``resources.time_limit_s``, else ``TLAB_DEFAULT_TIME_LIMIT_S``; it may not exceed
``TLAB_MAX_TIME_LIMIT_S`` nor the user's ``max_time_limit_s`` quota (admins: only the cluster's). Time counts
while the job runs (from ``started_at``, plus ``ran_s`` before a preemption). At the limit the scheduler stops
the Ray job (SIGTERM: the driver exports its artifacts from the last checkpoint; SIGKILL after
``TLAB_STOP_GRACE_S``) and the job ends ``failed`` with a reason that names the limit and the last epoch reported.

Storage: a running job's files on the storage volume (``<storage>/<id>``, a sweep's ``sweep-<id>`` too: its
checkpoints, artifacts, what its own code writes there) may hold at most ``TLAB_MAX_JOB_GB`` in at most
``TLAB_MAX_JOB_FILES`` entries (files, directories, links: the measure reads no more, so its time is bounded), and
with what its owner's ended jobs hold at most the owner's ``quotas.max_storage_gb`` (admins: only the first two).
The scheduler measures them every ``TLAB_STORAGE_CHECK_S``; over any, the job is stopped the same way and ends
``failed`` saying which and the figures (``storage_over``).
"""

from __future__ import annotations

import json
import math

from api_schemas import keys
from api_schemas.jobs import Role, UserPublic
from service.core.errors import InvalidInput
from service.core.settings import Settings
from service.core.storage_lifecycle import GB, used_bytes
from service.core.store import Store

TIME_LIMITED = "time_limited"  # job hash field: when the scheduler stopped the job at its time limit
STORAGE_LIMITED = "storage_limited"  # job hash field: why the scheduler stopped the job for the size of its files


def check_time_limit(settings: Settings, user: UserPublic, asked: float | None, field: str) -> None:
    """422 naming ``field`` when the limit asked for is over the cluster's maximum or the user's quota."""
    if asked is None:
        return
    if asked > settings.max_time_limit_s:
        raise InvalidInput(f"{asked:g} s is over this service's maximum of {settings.max_time_limit_s:g} s "
                           "(TLAB_MAX_TIME_LIMIT_S): ask for less, and checkpoint to go on in another job",
                           field=field)
    cap = user.quotas.max_time_limit_s
    if user.role != Role.ADMIN and asked > cap:
        raise InvalidInput(f"{asked:g} s is over your max_time_limit_s quota of {cap:g} s: ask for less, or ask "
                           "an admin to raise it", field=field)


def time_limit(settings: Settings, data: dict[str, str]) -> float:
    """A job's limit in seconds, from its stored spec (the sweep's base for a sweep), else the default."""
    if data.get("kind") == "sweep" and data.get("sweep"):
        # a sweep's own limit: its base spec's limit is each trial's (workers.sweep), not the whole sweep's
        return float(json.loads(data["sweep"]).get("time_limit_s") or settings.default_time_limit_s)
    asked = json.loads(data.get("spec") or "{}").get("resources", {}).get("time_limit_s")
    return float(asked or settings.default_time_limit_s)


def over_limit(settings: Settings, data: dict[str, str], now: float) -> float | None:
    """The job's limit if it is running and has run for at least that long, else None."""
    started = data.get("started_at")
    if data.get("state") != "running" or not started:
        return None
    limit = time_limit(settings, data)
    # before a preemption (service.scheduler.preempt): running time counts, not waiting
    ran = float(data.get("ran_s") or 0)
    return limit if ran + now - float(started) >= limit else None


def last_epoch(store: Store, job_id: str) -> int | None:
    """Epochs the job reported (the last ``metric`` event's epoch + 1), looking back a short way."""
    for _eid, fields in store.r.xrevrange(keys.events(job_id), count=500):
        if fields.get("kind") == "metric":
            return int(json.loads(fields["data"])["epoch"]) + 1
    return None


def time_limit_reason(store: Store, job_id: str, limit: float) -> str:
    """``time limit of 20 s reached at epoch 14`` (epochs done; its last checkpoint is an artifact)."""
    epoch = last_epoch(store, job_id)
    where = f"at epoch {epoch}" if epoch is not None else "before its first epoch ended"
    return (f"time limit of {limit:g} s reached {where}: its last checkpoint is kept as an artifact "
            "(raise resources.time_limit_s to train longer)")


def storage_over(settings: Settings, store: Store, data: dict[str, str], size: int, entries: int = 0) -> str:
    """Why a running job of ``size`` bytes in ``entries`` files and directories must stop ('' when it may go on):
    over ``TLAB_MAX_JOB_FILES`` or ``TLAB_MAX_JOB_GB``, or taking its owner (not an admin) past
    ``quotas.max_storage_gb`` with what their ended jobs hold."""
    if entries > settings.max_job_files:
        return (f"file limit: its directory holds more than {settings.max_job_files} files and directories, over "
                f"TLAB_MAX_JOB_FILES={settings.max_job_files}: stopped, its last checkpoint is kept (write fewer, "
                "larger files, an archive say, or ask an admin to raise the limit)")
    cap = settings.max_job_gb
    if size > cap * GB:
        return (f"storage limit: its files hold {size / GB:.2f} GB, over TLAB_MAX_JOB_GB={cap:g}: stopped, its last "
                "checkpoint is kept (write fewer or smaller files, or ask an admin to raise the limit)")
    user = store.user(data.get("owner", ""))
    quota = None if user is None or user.role == Role.ADMIN else user.quotas.max_storage_gb
    if quota is None:
        return ""
    used = used_bytes(store, user.name)
    if used + size <= quota * GB:
        return ""
    return (f"storage quota: its files hold {size / GB:.2f} GB and your ended jobs {used / GB:.2f} GB, over your "
            f"max_storage_gb quota of {quota:g}: stopped, its last checkpoint is kept (`tlab rm` ended jobs, or ask "
            "an admin to raise it)")


class StorageWatch:
    """When each running job's files were last measured: a job is measured at most every ``TLAB_STORAGE_CHECK_S``."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.measured: dict[str, float] = {}

    def due(self, job_id: str, now: float) -> bool:
        if now - self.measured.get(job_id, -math.inf) < self.every_s:
            return False
        self.measured[job_id] = now
        return True

    def keep(self, job_ids: set[str]) -> None:
        """Forget the jobs no longer running (the scheduler's active set)."""
        self.measured = {k: v for k, v in self.measured.items() if k in job_ids}
