"""Enqueue, after admission (``service.api.admission``): whether a gang can ever fit the cluster, where it would go
now (a dry run), and queueing it.

No FastAPI here: the routes in ``service/api/routes/`` turn these answers into responses.
"""

from __future__ import annotations

import math

from api_schemas.jobs import ClusterView, Demand, DryRun, ExperimentSubmit, JobState, JobView, Role, UserPublic
from api_schemas.preflight import PreflightResult
from api_schemas.sweeps import SweepSubmit
from service.api.views import PENDING_REASON
from service.core.storage_lifecycle import check_quota
from service.core.store import Store, demand_of
from service.launch.ray_cluster import StaticCluster
from service.rules import policy
from service.rules.after import check_after
from service.rules.preemptible import check_unpreemptible


def known_nodes(cluster_nodes: str, view: ClusterView | None) -> list[policy.Node] | None:
    """The nodes a gang must fit: ``TLAB_CLUSTER_NODES`` if set, else the scheduler's view (None: not known)."""
    if cluster_nodes:
        return StaticCluster(cluster_nodes).nodes()
    if view is None:
        return None
    return [policy.Node(n.id, n.cpus_total, n.gpus_total, gpu_type=n.gpu_type, memory_gb=n.memory_gb_total)
            for n in view.nodes if n.alive]  # (a dead node is listed until its host joins again)


def never_fits(demand: Demand, nodes: list[policy.Node] | None) -> str | None:
    """Why the gang can never fit the known nodes (None if it can, or if no node is known yet)."""
    return policy.never_fits(demand, nodes) if nodes else None


def dry_run_view(demand: Demand, view: ClusterView | None, nodes: list[policy.Node] | None) -> DryRun:
    """Whether the gang fits ever and now, and on which nodes (free room from the scheduler's view if any)."""
    why = never_fits(demand, nodes)
    free = ({n.id: [n.cpus_free, n.gpus_free, math.inf if n.memory_gb_free is None else n.memory_gb_free]
             for n in view.nodes if n.alive} if view else {n.id: n.room() for n in nodes or []})
    placement = policy.place(demand, policy.of_type(free, nodes, demand)) if nodes else None
    reason = why or (None if placement else "no room now: it would wait in the queue" if nodes
                     else "the cluster is not known yet: no scheduler has reported")
    return DryRun(demand=demand, fits_ever=why is None, fits_now=placement is not None, placement=placement or [],
                  reason=reason)


def enqueue(store: Store, user: UserPublic, body: ExperimentSubmit | SweepSubmit,
            idempotency_key: str | None, extra: dict[str, str] | None = None) -> tuple[JobView, bool]:
    """Queue the job: (its view, True), or (the original job, False) on an Idempotency-Key replay; 429 when
    the user has ``max_queued_jobs`` queued (checked and queued in one Lua call; admins are not bound); 422 naming
    ``after`` for a dependency the user may not wait for, that can no longer succeed, or that closes a cycle; 422
    naming ``resources.preemptible`` over the user's ``max_unpreemptible`` quota."""
    check_after(store, user, body.after)
    check_unpreemptible(store, user, body, idempotency_key)
    check_quota(store, user)  # max_storage_gb: what the user's ended jobs hold
    owner = user.name
    cap = None if user.role == Role.ADMIN else user.quotas.max_queued_jobs
    job_id, created, qlen, now = store.submit(owner, body, idempotency_key, queued_cap=cap, extra=extra)
    if not created:
        return store.view(job_id, with_progress=False), False
    experiment = isinstance(body, ExperimentSubmit)
    spec = body.spec if isinstance(body, ExperimentSubmit) else body.base
    return JobView(id=job_id, kind="experiment" if experiment else "sweep", name=body.name or job_id, owner=owner,
                   state=JobState.QUEUED, priority=body.priority, tags=body.tags, spec=spec, demand=demand_of(body),
                   created_at=now, queue_position=qlen, pending_reason=PENDING_REASON,
                   after=list(dict.fromkeys(body.after)), notify=body.notify,
                   preflight=PreflightResult(state="waiting") if spec.user_code_fields() else None), True
