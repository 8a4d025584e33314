"""``POST /v1/experiments?dry_run=true`` for a spec that runs the user's code: its preflight, inside the request.

The preflight runs on Ray as the scheduler runs it (``service.launch.preflight_jobs``: 1 CPU, the package and
requirements as runtime_env, a Redis user of its own), never in the API process, under a throwaway id: its spec goes to
the id's ``run`` copy, its verdict comes back, and every trace of it (keys, Redis user, logs) goes. Nothing is queued.
At most ``TLAB_PREFLIGHT_MAX`` at once per API process (429 above); each within ``TLAB_PREFLIGHT_TIMEOUT_S``.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

from api_schemas import keys
from api_schemas.jobs import DryRun, UserPublic
from api_schemas.preflight import PreflightResult
from api_schemas.spec import ExperimentSpec
from service.core import storage
from service.core.code_store import runtime_env_for
from service.core.errors import Forbidden, InvalidInput, ServiceError, TooManyRequests
from service.core.settings import Settings
from service.core.store import new_job_id
from service.launch import preflight_jobs as pf
from service.launch.job_acl import JobAcl
from service.launch.job_env import job_env
from service.launch.preflight_jobs import PreflightJobs
from service.launch.ray_cluster import RAY_DONE

POLL_S = 0.1
_running: dict[str, int] = {"n": 0}
_lock = threading.Lock()


class RayUnavailable(ServiceError):
    status = 503


def _slot(settings: Settings) -> None:
    with _lock:
        if _running["n"] >= settings.preflight_max:
            raise TooManyRequests(f"{_running['n']} dry runs with code are running here, TLAB_PREFLIGHT_MAX="
                                  f"{settings.preflight_max}: try again shortly", field="dry_run", retry_after_s=5)
        _running["n"] += 1


def _release() -> None:
    with _lock:
        _running["n"] -= 1


def dry_preflight(settings: Settings, r: Any, user: UserPublic, spec: ExperimentSpec) -> PreflightResult:
    """The preflight of ``spec`` (run as ``user``'s code), on Ray; its verdict, passed or failed."""
    _slot(settings)
    job_id = new_job_id(time.time())
    try:
        try:
            jobs = PreflightJobs(settings.ray_address, job_env(settings))
        except Exception as err:
            raise RayUnavailable(f"Ray is not reachable at {settings.ray_address} ({type(err).__name__}), so the "
                                 "dry run cannot try your code: try again when the cluster is up",
                                 field="dry_run") from None
        return _run(settings, r, jobs, user, spec, job_id)
    finally:
        _cleanup(settings, r, job_id)
        _release()


def dry_run_answer(settings: Settings, r: Any, user: UserPublic, spec: ExperimentSpec, dry: DryRun) -> DryRun:
    """The admission's dry run, with the preflight's result for a spec that runs the user's code; a failed
    preflight is the 422 of its one line (field ``spec``)."""
    if not spec.user_code_fields():
        return dry  # built-in code: the admission checks alone (docs/rest.md)
    result = dry_preflight(settings, r, user, spec)
    if result.state != "passed":
        raise InvalidInput(f"preflight failed: {result.error}", field="spec")
    return dry.model_copy(update={"preflight": result})


def _run(settings: Settings, r: Any, jobs: PreflightJobs, user: UserPublic, spec: ExperimentSpec,
         job_id: str) -> PreflightResult:
    acl = JobAcl(r, settings)
    if settings.job_redis_acl and not acl.isolated:
        raise Forbidden(f"this spec runs your code, and the service cannot give it a Redis user of its own "
                        f"({acl.unsupported}): an admin may set TLAB_JOB_REDIS_ACL=off", field="spec")
    env = acl.credentials(job_id, pf.preflight_sid(job_id), pf.preflight_user(job_id))
    r.hset(keys.job_run(job_id), mapping={keys.JOB_RUN_MARK: job_id, "spec": spec.model_dump_json()})
    deadline = time.monotonic() + settings.preflight_timeout_s
    jobs.start(job_id, runtime_env_for(settings, user.name, spec), env, memory_gb=spec.resources.memory_gb)
    sid = pf.preflight_sid(job_id)
    while (status := jobs.status(sid)) not in RAY_DONE:
        if time.monotonic() > deadline:
            jobs.stop(sid)
            return PreflightResult(state="failed", error=pf.timeout_reason(settings.preflight_timeout_s))
        time.sleep(POLL_S)
    verdict = pf.read_verdict(r, job_id)
    return verdict or PreflightResult(state="failed", error=pf.no_verdict(jobs, job_id, status))


def _cleanup(settings: Settings, r: Any, job_id: str) -> None:
    pf.drop_user(r, job_id)
    r.delete(keys.job_run(job_id), keys.preflight(job_id), keys.events(job_id), keys.emitted(job_id))
    shutil.rmtree(Path(settings.storage_path) / job_id, ignore_errors=True)
    storage.delete(settings, job_id)  # its log, when a bucket is the storage
