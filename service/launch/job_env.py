"""The environment every Ray job the service starts gets (an experiment, a sweep, a preflight, a dry run)."""

from __future__ import annotations

import os

from service.core.settings import Settings
from service.core.storage import storage_env


def job_env(settings: Settings) -> dict[str, str]:
    """What every Ray job gets: where Redis and the checkpoints are, and how long a stop may take (``REDIS_URL``:
    the service's, replaced at each submit by a one-time ticket to the job's own Redis user, ``TLAB_JOB_TICKET``,
    unless jobs are not isolated: ``service.launch.job_acl``, ``service.launch.ray_cluster.with_credentials``)."""
    env = {"REDIS_URL": settings.redis_url, "TLAB_STORAGE": settings.storage_path,
           "TLAB_MAX_FAILURES": str(settings.max_failures), "RAY_JOB_STOP_WAIT_TIME_S": str(int(settings.stop_grace_s)),
           "TLAB_KEEP_CHECKPOINTS": str(settings.keep_checkpoints),
           "TLAB_CHECKPOINT_EVERY_S": str(settings.checkpoint_every_s),
           # the sandbox (workers.job.sandbox): on or off, and what it must cover even under a directory it binds
           "TLAB_SANDBOX": settings.sandbox, "TLAB_SANDBOX_HIDE": f"{settings.home}:{settings.storage_path}",
           "TLAB_SANDBOX_TMP_MB": str(settings.sandbox_tmp_mb),
           "TLAB_DATA_ROOTS": ":".join(map(str, settings.data_root_paths)),  # the only dataset mounts
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.update(storage_env(settings))  # with a bucket: its URI and credentials (workers.job.bucket)
    for name in ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "TLAB_DATA", "TLAB_IN_DRIVER", "TLAB_TRIAL_RETRIES",
                 "TLAB_JOB_UID_BASE", "TLAB_JOB_UIDS", "TLAB_JOB_GID", "TLAB_SANDBOX_MAX_PROCS"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env
