"""Starting a preflight on Ray (``python -m workers.preflight --job ID`` as a small Ray job), and reading its verdict.

Shared by the scheduler (``service.scheduler.preflight``: every queued job that runs the user's code) and the API's dry
run (``service.api.dry_run``). The Ray job asks for ``PREFLIGHT_CPUS`` CPU, no GPU and the job's
``resources.memory_gb`` (its supervisor holds the preflight to it, as the training), on the node the scheduler chose
when it is a Ray node; it runs in the job's runtime_env (its package as ``working_dir``, its requirements as ``pip``)
and reaches Redis as a user of its own, ``tlab-preflight-<id>``, allowed the job's keys only
(``service.launch.job_acl.rules``; a name ``JobAcl.sync`` leaves alone), whose ``REDIS_URL`` it redeems at start with
the one-time ticket in its runtime_env (ticket user ``tlab-ticket-preflight-<id>``, as a job's; the names:
``service.launch.redis_users``).
"""

from __future__ import annotations

from typing import Any

from api_schemas import keys
from api_schemas.preflight import PreflightResult
from api_schemas.spec import ray_memory
from service.launch.ray_cluster import _RAY_NODE_ID, NODE_ID_LABEL, RayJobs, with_credentials
from service.launch.ray_reasons import reason_from_ray
from service.launch.redis_users import preflight_user, ticket_user

PREFLIGHT_CPUS = 1.0
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # it runs on the CPU, and its code sees no GPU of the node
MODULE = "workers.preflight"


def preflight_sid(job_id: str) -> str:
    """The preflight's Ray submission id: one per job, so a restarted scheduler never starts it twice."""
    return f"tlab-{job_id}-preflight"


def timeout_reason(timeout_s: float) -> str:
    return (f"the preflight did not finish within TLAB_PREFLIGHT_TIMEOUT_S={timeout_s:g} s (installing "
            "code.requirements, importing your code, building model and data, one step and one teleport on one "
            "CPU): make them lighter (dataset.max_train, smaller factory args) or ask an admin to raise it")


class PreflightJobs(RayJobs):
    """``RayJobs`` (status, stop, message) plus the preflight's own submit."""

    def start(self, job_id: str, code_env: dict[str, Any], env: dict[str, str], node: str = "",
              memory_gb: float | None = None) -> None:
        """Submit the preflight of ``job_id`` (a second call for the same job is a no-op)."""
        python = "python" if code_env.get("pip") else self.python
        options: dict[str, Any] = {"entrypoint_num_cpus": PREFLIGHT_CPUS}
        if memory_gb:
            options["entrypoint_memory"] = ray_memory(memory_gb)
        if node and _RAY_NODE_ID.fullmatch(node):
            options["entrypoint_label_selector"] = {NODE_ID_LABEL: node}
        try:
            self.client.submit_job(entrypoint=f"{python} -m {MODULE} --job {job_id}",
                                   submission_id=preflight_sid(job_id),
                                   runtime_env={"env_vars": {**with_credentials(self.env, env), **NO_GPU},
                                                **code_env},
                                   metadata={"tlab_job": job_id, "tlab_preflight": "true"}, **options)
        except RuntimeError as err:  # the Jobs API answers an existing id with HTTP 400 "already exists"
            if "already exists" not in str(err):
                raise


def read_verdict(r: Any, job_id: str) -> PreflightResult | None:
    """What the preflight wrote (None: nothing, or nothing that validates: it is the job's own process)."""
    raw = r.hget(keys.preflight(job_id), "result")
    if not raw:
        return None
    try:
        return PreflightResult.model_validate_json(raw)
    except ValueError:
        return None


def no_verdict(jobs: PreflightJobs, job_id: str, status: str | None) -> str:
    """Why a preflight that wrote no verdict ended, in Ray's words (a requirement pip could not install)."""
    said = reason_from_ray(jobs.message(preflight_sid(job_id)))
    return f"the preflight ended ({status}) without a verdict" + (f": {said}" if said else "")


def drop_user(r: Any, job_id: str) -> None:
    """The preflight's Redis user and its ticket's go (Redis disconnects its clients); absent is fine."""
    ticket = ticket_user(preflight_user(job_id))
    r.delete(keys.ticket(ticket))
    try:
        r.execute_command("ACL", "DELUSER", preflight_user(job_id), ticket)
    except Exception:  # a Redis without ACL: there was no user
        pass
