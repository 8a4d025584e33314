"""The scheduler's preflights: a queued job that runs the user's code waits for its gang until it passed one.

Each tick, before the policy decides (``Preflights.step``), for every queued job whose spec runs the user's code
(``ExperimentSpec.user_code_fields``):

- not tried yet: its preflight starts when one of ``TLAB_PREFLIGHT_MAX`` slots and a free CPU are there (the
  node with the most free CPUs, among those with the job's ``resources.memory_gb`` free if any: its Ray job then
  reserves it; else unreserved, held to it by its supervisor, rather than wait for memory a stream of smaller jobs
  could keep taking): the job hash gets ``preflight=running``, its node, memory and start time *before* the submit
  (a scheduler killed in between finds it and submits the same id again; Ray refuses a duplicate), and the id
  joins ``keys.preflights()``;
- running: its CPU and the memory it reserved are held in the policy's view of the nodes (``hold``) until it
  ends; over ``TLAB_PREFLIGHT_TIMEOUT_S`` (from its submit: runtime env and pip included) it is stopped and the
  job fails;
- ended: the verdict it wrote (``keys.preflight``) is copied into the job hash (``preflight_result``): passed, the
  job competes for its gang from the next decision; failed, the job ends ``failed`` with the verdict's one line (or
  Ray's, when it died without one: a requirement that could not be installed);

and any job in ``keys.preflights()`` that is no longer queued (cancelled) has its preflight stopped. A job that
waits shows why in its queue reason (``preflight running``). A job preempted or requeued keeps its ``passed``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from api_schemas import keys
from api_schemas.jobs import JobState
from api_schemas.reasons import one_line
from api_schemas.spec import ExperimentSpec
from service.core.errors import Unstartable
from service.core.settings import Settings
from service.core.store import Store
from service.launch.job_acl import JobAcl
from service.launch.preflight_jobs import (
    PREFLIGHT_CPUS,
    PreflightJobs,
    drop_user,
    no_verdict,
    preflight_sid,
    preflight_user,
    read_verdict,
    timeout_reason,
)
from service.launch.ray_cluster import RAY_ACTIVE
from service.rules import policy
from service.rules.policy import ActiveJob, Node, QueuedJob

log = logging.getLogger("tlab.scheduler")
# the scheduler's own, in the job hash (preflight_memory: the GiB its Ray job reserves)
FIELDS = ["preflight", "preflight_started", "preflight_node", "preflight_memory"]


def needs_preflight(raw_spec: str | None) -> bool:
    try:
        return bool(raw_spec) and bool(ExperimentSpec.model_validate_json(raw_spec or "").user_code_fields())
    except ValueError:  # a stored spec that no longer validates: the worker says so in its own words
        return False


class Preflights:
    def __init__(self, store: Store, settings: Settings, jobs: PreflightJobs, acl: JobAcl | None,
                 code: Any) -> None:
        self.store, self.r, self.settings, self.jobs, self.acl = store, store.r, settings, jobs, acl
        self.code = code  # job id -> its runtime_env part (service.core.code_store.JobCode)
        self.needs: dict[str, bool] = {}  # job id -> runs the user's code and has not passed yet (cached)
        # job id -> (node, GiB of memory its Ray job reserves) of each preflight in flight
        self.held: dict[str, tuple[str, float]] = {}

    # ---- the policy's view ------------------------------------------------------------------
    def hold(self, nodes: list[Node]) -> list[Node]:
        """The nodes less the CPUs and memory the preflights in flight hold (in Ray's own count of what is used
        too)."""
        held: dict[str, list[float]] = {}  # node -> [CPUs, GiB]
        for node, memory in self.held.values():
            h = held.setdefault(node, [0.0, 0.0])
            h[0] += PREFLIGHT_CPUS
            h[1] += memory
        return [_less(n, *held[n.id]) if n.id in held else n for n in nodes]

    # ---- each tick ------------------------------------------------------------------------------
    def step(self, queued: list[QueuedJob], nodes: list[Node], active: list[ActiveJob], now: float
             ) -> dict[str, str]:
        """Settle, time out and start preflights; the queued jobs that must not start yet -> why."""
        self.forget_gone()
        self.needs = {q.id: self.needs[q.id] for q in queued if q.id in self.needs}
        fresh = [q.id for q in queued if q.id not in self.needs]
        if fresh:
            pipe = self.r.pipeline(transaction=False)
            for job_id in fresh:
                pipe.hmget(keys.job(job_id), ["spec", "preflight"])
            for job_id, (spec, state) in zip(fresh, pipe.execute(), strict=True):
                self.needs[job_id] = state != "passed" and needs_preflight(spec)
        free = policy.free_resources(self.hold(nodes), active)
        blocked: dict[str, str] = {}
        for job in queued:
            if self.needs.get(job.id):
                why = self.one(job, free, now)
                if why:
                    blocked[job.id] = why
                else:
                    self.needs[job.id] = False
        return blocked

    def one(self, job: QueuedJob, free: dict[str, list[float]], now: float) -> str:
        """Move one job's preflight along; why the job waits ('' once it passed)."""
        job_id = job.id
        if job_id not in self.held and len(self.held) >= self.settings.preflight_max:
            return self.no_slot()
        data = dict(zip(FIELDS, self.r.hmget(keys.job(job_id), FIELDS), strict=True))
        state = data["preflight"] or ""
        if state == "passed":
            return ""
        if state == "failed":
            return "its preflight failed"
        try:
            if state == "running":
                return self.check(job_id, data, now)
            return self.start(job_id, job.demand.memory_gb or 0.0, free, now)
        except Exception:  # one job's Ray trouble must not stop this tick's other decisions
            log.exception("preflight of %s", job_id)
            return "preflight running: its code is tried on one CPU before its gang is held"

    def start(self, job_id: str, memory: float, free: dict[str, list[float]], now: float) -> str:
        """Start the preflight of a job whose workers need ``memory`` GiB each, if a slot and a CPU are free."""
        if len(self.held) >= self.settings.preflight_max:
            return self.no_slot()
        refusal = self.acl.refusal(job_id) if self.acl else ""
        if refusal:  # user code that Redis cannot isolate: it must not run, not even a preflight
            self.fail(job_id, refusal, now)
            return refusal
        fitting = [k for k, room in free.items() if room[0] + policy.EPS >= PREFLIGHT_CPUS]
        if not fitting:
            return "preflight waiting for a free CPU: its code is tried on one CPU before its gang is held"
        # the job's memory reserved where it is free; else the preflight runs unreserved (held to it by its
        # supervisor) rather than wait for memory that a stream of smaller jobs could keep taking
        roomy = [k for k in fitting if free[k][2] + policy.EPS >= memory]
        node = max(roomy or fitting, key=lambda k: free[k][0])
        memory = memory if roomy else 0.0
        free[node][0] -= PREFLIGHT_CPUS
        free[node][2] -= memory
        self.r.hset(keys.job(job_id), mapping={"preflight": "running", "preflight_started": repr(now),
                                               "preflight_node": node, "preflight_memory": repr(memory)})
        self.r.sadd(keys.preflights(), job_id)
        self.held[job_id] = (node, memory)
        if not self.submit(job_id, node, now):
            return "it cannot start"
        return "preflight running: its code is tried on one CPU before its gang is held"

    def no_slot(self) -> str:
        return (f"waiting for a preflight slot ({len(self.held)} of TLAB_PREFLIGHT_MAX="
                f"{self.settings.preflight_max} running): its code is tried on one CPU before its gang is held")

    def submit(self, job_id: str, node: str, now: float) -> bool:
        """The preflight's Ray job (its own Redis user first); a refusal leaves it to the next tick's check. False:
        the job can never start as stored (its package is gone: it failed)."""
        try:
            code = self.code(job_id)
            if self.jobs.status(preflight_sid(job_id)) is not None:
                return True  # Ray has it: never arm its (maybe redeemed) ticket again (``RayJobs.submit``)
            env = self.acl.credentials(job_id, preflight_sid(job_id), preflight_user(job_id)) if self.acl else {}
            self.jobs.start(job_id, code, env, node, memory_gb=self.held[job_id][1] or None)
        except Unstartable as err:
            self.fail(job_id, one_line(str(err)), now)
            return False
        except Exception:  # Ray refused or is down: the next tick finds it unknown to Ray and submits again
            log.exception("submitting the preflight of %s", job_id)
        return True

    def check(self, job_id: str, data: dict[str, Any], now: float) -> str:
        sid = preflight_sid(job_id)
        self.held.setdefault(job_id, (data["preflight_node"] or "", float(data["preflight_memory"] or 0)))
        status = self.jobs.status(sid)
        elapsed = now - float(data["preflight_started"] or now)
        if status in RAY_ACTIVE or status is None:
            if elapsed > self.settings.preflight_timeout_s:
                if status is not None:
                    self.jobs.stop(sid)
                self.fail(job_id, timeout_reason(self.settings.preflight_timeout_s), now)
                return "its preflight timed out"
            if status is None and not self.submit(job_id, data["preflight_node"] or "", now):
                return "it cannot start"  # (None: a scheduler killed before its submit, or a restarted cluster)
            if status is not None and self.acl and self.acl.isolated and not self.r.acl_getuser(preflight_user(job_id)):
                self.acl.restore(job_id, sid, preflight_user(job_id))  # a restarted Redis lost it
            return f"preflight running ({elapsed:.0f} s): its code is tried on one CPU before its gang is held"
        verdict = read_verdict(self.r, job_id)
        if verdict is not None:  # what the job waited, whatever the payload said of it
            verdict = verdict.model_copy(update={"wall_seconds": round(elapsed, 2)})
        if verdict is not None and verdict.state == "passed":
            self.r.hset(keys.job(job_id), mapping={"preflight": "passed", "preflight_result":
                                                   verdict.model_dump_json()})
            self.done(job_id)
            self.store.log_event(job_id, "info", f"preflight passed ({elapsed:.1f} s from its submit to Ray)", now)
            return ""
        reason = verdict.error if verdict is not None and verdict.error else no_verdict(self.jobs, job_id, status)
        self.fail(job_id, one_line(reason), now, verdict.model_dump_json() if verdict else "")
        return "its preflight failed"

    # ---- endings ----------------------------------------------------------------------------
    def fail(self, job_id: str, reason: str, now: float, result: str = "") -> None:
        from api_schemas.preflight import PreflightResult

        result = result or PreflightResult(state="failed", error=reason).model_dump_json()
        self.r.hset(keys.job(job_id), mapping={"preflight": "failed", "preflight_result": result})
        self.store.transition(job_id, JobState.FAILED, expect=[JobState.QUEUED], now=now,
                              reason=f"preflight failed: {reason}", failure_reason=reason)
        self.done(job_id)

    def done(self, job_id: str) -> None:
        self.r.srem(keys.preflights(), job_id)
        self.held.pop(job_id, None)
        drop_user(self.r, job_id)
        self.r.delete(keys.job_run(job_id))

    def forget_gone(self) -> None:
        """Preflights of jobs no longer queued (cancelled meanwhile) are stopped; the rest are known again after a
        restart (their nodes and memory held)."""
        ids = sorted(self.r.smembers(keys.preflights()))
        if not ids:
            self.held.clear()
            return
        pipe = self.r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(keys.job(job_id), ["state", "preflight_node", "preflight_memory"])
        for job_id, (state, node, memory) in zip(ids, pipe.execute(), strict=True):
            if state == JobState.QUEUED.value:
                self.held[job_id] = (node or "", float(memory or 0))
                continue
            try:
                self.jobs.stop(preflight_sid(job_id))
            except Exception:
                log.exception("stopping the preflight of %s", job_id)
                continue
            self.r.hset(keys.job(job_id), "preflight", "stopped")
            self.done(job_id)
        self.held = {k: v for k, v in self.held.items() if k in set(ids)}


def _less(node: Node, cpus: float, memory: float) -> Node:
    """``node`` less what its preflights hold, in the totals and in Ray's count of what is used."""
    return replace(node, cpus=node.cpus - cpus,
                   cpus_used=None if node.cpus_used is None else max(0.0, node.cpus_used - cpus),
                   memory_gb=None if node.memory_gb is None else node.memory_gb - memory,
                   memory_used_gb=None if node.memory_used_gb is None else max(0.0, node.memory_used_gb - memory))
