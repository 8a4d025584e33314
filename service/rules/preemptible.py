"""Which jobs may be preempted, read at submit and by the scheduler: a job's ``resources.preemptible``, the job-hash
fields that mark a preemption under way, and the ``max_unpreemptible`` quota at submit (docs/operations.md,
Preemption). The choice of victims is ``service.rules.victims``; acting on it, ``service.scheduler.preempt``."""

from __future__ import annotations

import json

from api_schemas import keys
from api_schemas.jobs import ExperimentSubmit, JobState, Role, UserPublic
from api_schemas.sweeps import SweepSubmit
from service.core.errors import InvalidInput
from service.core.store import Store

PREEMPTED_BY, PREEMPTED_PRIORITY = "preempted_by", "preempted_priority"  # job hash fields while it stops


LIVE = (JobState.QUEUED.value, JobState.STARTING.value, JobState.RUNNING.value)


def preemptible(data: dict[str, str]) -> bool:
    """The job's ``resources.preemptible`` (a sweep's: its base spec's, which is what ``spec`` holds)."""
    return bool(json.loads(data.get("spec") or "{}").get("resources", {}).get("preemptible", True))


def unpreemptible_jobs(store: Store, owner: str) -> list[str]:
    """The owner's queued, starting or running jobs with ``resources.preemptible=false``."""
    ids = set(store.r.zrange(keys.user_queued(owner), 0, -1)) | set(store.r.smembers(keys.active()))
    return [d["id"] for d in store.raws(sorted(ids))
            if d.get("owner") == owner and d.get("state") in LIVE and not preemptible(d)]


def check_unpreemptible(store: Store, user: UserPublic, body: ExperimentSubmit | SweepSubmit,
                        idempotency_key: str | None) -> None:
    """422 naming ``resources.preemptible`` when a non-preemptible job would take the user over their
    ``max_unpreemptible`` quota (admins are not bound; a replayed Idempotency-Key is the job already counted)."""
    spec, field = ((body.spec, "spec") if isinstance(body, ExperimentSubmit) else (body.base, "base"))
    if spec.resources.preemptible or user.role == Role.ADMIN:
        return
    if idempotency_key and store.r.exists(keys.idempotency(user.name, idempotency_key)):
        return
    cap, field = user.quotas.max_unpreemptible, f"{field}.resources.preemptible"
    if cap == 0:
        raise InvalidInput("your max_unpreemptible quota is 0: submit it preemptible (it then resumes from its "
                           "checkpoint if preempted), or ask an admin to raise the quota", field=field)
    held = unpreemptible_jobs(store, user.name)
    if len(held) >= cap:
        raise InvalidInput(f"you have {len(held)} non-preemptible jobs queued or running ({', '.join(held)}), your "
                           f"max_unpreemptible quota is {cap}: submit this one preemptible, or wait until one ends",
                           field=field)
