"""Preemption on Redis and Ray: what the scheduler does once ``service.rules.victims`` has chosen the victims
(docs/operations.md, Preemption; which jobs may be preempted: ``service.rules.preemptible``).

1. mark: the victim's hash gets ``preempted_by``/``preempted_priority``, its stream a log event
   ``preempted by <job> (priority P): ...`` (another user's job not by its id), and its Ray job a stop (SIGTERM:
   the driver exports its artifacts from the last per-epoch checkpoint; SIGKILL after ``TLAB_STOP_GRACE_S``), as
   the time-limit path does;
2. requeue (``Scheduler.reconcile`` once Ray reports it stopped): ``running -> queued`` at its original
   ``created_at`` (the queue's score: it keeps its age), ``preemptions`` + 1, ``last_preemption`` says by which
   job and when, ``ran_s`` adds the time it ran (time limits count running time across preemptions) and
   ``resume_free`` spares it the start charge when it resumes (fair share charges only the time it ran).
   ``attempts`` still counts starts (each needs a new Ray submission id), but a preemption is no failure: the
   scheduler compares ``attempts - preemptions`` with ``TLAB_MAX_ATTEMPTS``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from api_schemas import keys
from api_schemas.jobs import Demand, JobState
from service.core.settings import Settings
from service.core.store import Store
from service.launch.ray_cluster import RAY_ACTIVE
from service.rules import policy
from service.rules import victims as preemption
from service.rules.limits import TIME_LIMITED
from service.rules.policy import ActiveJob
from service.rules.preemptible import PREEMPTED_BY, PREEMPTED_PRIORITY, preemptible

log = logging.getLogger("tlab.scheduler")
LOST_NODE = "lost-node"  # the PREEMPTED_PRIORITY of a job stopped because a node of its gang is gone
LEAVING_NODE = "leaving-node"  # ... because a node of its gang is leaving (`tlab leave`: service.scheduler.leaving)
NODE_GONE = (LOST_NODE, LEAVING_NODE)  # no preemptor: the cause is the whole reason, and no failure is counted
SETTLE_S = 15.0  # after a preemption, Ray's report of what is in use may lag this long (its autoscaler: ~5 s)


class Stopper(Protocol):
    def stop(self, submission_id: str) -> None: ...


def active_job(data: dict[str, str]) -> ActiveJob:
    """A starting/running job's gang and where it runs, from its hash."""
    return ActiveJob(data["id"], data["owner"], Demand.model_validate_json(data["demand"]),
                     tuple(json.loads(data.get("placement") or "[]")))


def stopping(data: dict[str, str]) -> bool:
    """On its way out already: preempted, cancelled, or at its time limit."""
    return bool(data.get(PREEMPTED_BY) or data.get("cancel_requested") or data.get(TIME_LIMITED))


def candidates(raws: list[dict[str, str]]) -> tuple[list[preemption.Candidate], list[ActiveJob]]:
    """The running jobs that may be preempted (if their priority is lower), and the jobs already stopping."""
    running, leaving = [], []
    for data in raws:
        if stopping(data):
            leaving.append(active_job(data))
        elif data.get("state") == JobState.RUNNING.value:
            running.append(preemption.Candidate(active_job(data), int(data.get("priority") or 0),
                                                float(data.get("started_at") or 0), preemptible(data)))
    return running, leaving


def preempt(store: Store, launcher: Stopper, settings: Settings, decision: policy.Decision,
            nodes: list[policy.Node], active: list[ActiveJob], now: float, requeued_at: float = 0.0) -> list[str]:
    """Stop the victims for the job that waits for room, if any (``service.rules.victims``), and say so in that
    job's reason; returns the victims' ids. ``requeued_at``: when a preempted job last went back to the queue
    (for ``SETTLE_S`` after it, Ray's lagging report of what is in use does not make more victims)."""
    job = decision.reserved
    if job is None or not settings.preemption:
        return []
    raws = store.raws(a.id for a in active)
    running, leaving = candidates(raws)
    free = policy.of_type(policy.free_resources(nodes, active), nodes, job.demand)  # its GPU model's nodes only
    ledger = [replace(n, cpus_used=None, gpus_used=None, memory_used_gb=None) for n in nodes]  # Ray's count aside
    released = (policy.of_type(policy.free_resources(ledger, active), nodes, job.demand)
                if now - requeued_at < SETTLE_S else None)
    plan = preemption.plan(job.demand, job.priority, free, running, leaving, released=released, reader=job.owner)
    decision.order = [(i, why + plan.note if i == job.id else why) for i, why in decision.order]
    by = {d["id"]: d for d in raws}
    for victim in plan.victims:
        log.info("preempting %s (priority %d) for %s (priority %d)", victim.id, victim.priority, job.id,
                 job.priority)
        preemptor = policy.named(job.id, job.owner, victim.job.owner)  # the victim's owner reads it
        store.r.hset(keys.job(victim.id), mapping={PREEMPTED_BY: preemptor, PREEMPTED_PRIORITY: str(job.priority)})
        store.log_event(victim.id, "info", f"preempted by {preemptor} (priority {job.priority}): checkpointing and "
                                           f"stopping (TLAB_STOP_GRACE_S={settings.stop_grace_s:g})", now)
        try:
            launcher.stop(by[victim.id].get("ray_job_id", ""))
        except Exception:  # Ray down or slow: the mark stays, and reconcile stops it on the next tick
            log.exception("stopping %s for a preemption", victim.id)
    return [v.id for v in plan.victims]


def evict_from_lost_nodes(store: Store, launcher: Stopper, nodes: list[policy.Node], active: list[ActiveJob],
                          now: float, names: Mapping[str, str] | None = None) -> list[str]:
    """Stop the jobs placed on a node Ray no longer reports alive (its raylet died, its machine went away) and
    mark them as preempted by that loss: once stopped they go back to the queue like a preempted job, and resume
    from their last checkpoint where the gang fits again (or wait saying the cluster lacks the room). ``names``: node
    id -> how people name it (``host (address)``)."""
    alive = {n.id for n in nodes}
    if not alive:  # no node at all is a cluster view that failed, not every node lost at once
        return []
    raws = {d["id"]: d for d in store.raws(a.id for a in active)}
    evicted = []
    for job in active:
        lost = sorted(set(job.placement) - alive)
        data = raws.get(job.id)
        if not lost or data is None or stopping(data):
            continue
        cause = f"the loss of node {(names or {}).get(lost[0]) or lost[0][:12]}"
        evict(store, launcher, data, cause, LOST_NODE, "Ray no longer reports it alive", now)
        evicted.append(job.id)
    return evicted


def evict(store: Store, launcher: Stopper, data: dict[str, str], cause: str, marker: str, why: str,
          now: float) -> None:
    """Mark a job as preempted by ``cause`` (``marker``: one of ``NODE_GONE``), say so in its log (``why``: what
    happened to the node), and stop its Ray job: once stopped it goes back to the queue (``requeue``)."""
    log.info("%s: %s; stopping it to resume elsewhere", data["id"], cause)
    store.r.hset(keys.job(data["id"]), mapping={PREEMPTED_BY: cause, PREEMPTED_PRIORITY: marker})
    store.log_event(data["id"], "info", f"{cause}: {why}; stopping this attempt to resume from the last checkpoint "
                                        "where the gang fits", now)
    try:
        launcher.stop(data.get("ray_job_id", ""))
    except Exception:  # Ray down or slow: the mark stays, and reconcile stops it on the next tick
        log.exception("stopping %s (%s)", data["id"], cause)


def requeue(store: Store, data: dict[str, str], now: float) -> bool:
    """A preempted job whose Ray job stopped: back to the queue with its age, counted (module doc)."""
    by, priority = data.get(PREEMPTED_BY, ""), data.get(PREEMPTED_PRIORITY, "?")
    cause = by if priority in NODE_GONE else f"preempted by {by} (priority {priority})"
    ran = float(data.get("ran_s") or 0) + max(0.0, now - float(data.get("started_at") or now))
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
    reason = f"{cause}: queued again to resume from its last checkpoint"
    return store.transition(data["id"], JobState.QUEUED, expect=[JobState.STARTING, JobState.RUNNING], now=now,
                            reason=reason, preemptions=str(int(data.get("preemptions") or 0) + 1),
                            last_preemption=f"{cause} at {when}", ran_s=repr(ran),
                            resume_free="1", **{PREEMPTED_BY: "", PREEMPTED_PRIORITY: ""})


def settling(data: dict[str, str], status: str | None) -> bool:
    """A preempted job (or one stopped for a lost or leaving node) that Ray still runs or has let go: the preemption
    path stops or requeues it. A lost or leaving node's job may also have failed by itself when its worker there died
    (a leaving node stops its Ray node at the end of its wait)."""
    ends = (*RAY_ACTIVE, "STOPPED", None, *(("FAILED",) if data.get(PREEMPTED_PRIORITY) in NODE_GONE else ()))
    return bool(data.get(PREEMPTED_BY)) and status in ends


def failed_attempts(data: dict[str, str]) -> int:
    """Starts that did not end in a preemption, since the sweep was last rerun: what ``TLAB_MAX_ATTEMPTS``
    bounds."""
    return (int(data.get("attempts") or 1) - int(data.get("preemptions") or 0)
            - int(data.get("attempts_before_rerun") or 0))


