"""``python -m service.scheduler``: the one process that starts jobs on Ray and keeps Redis in step with it.

Each tick (every ``TLAB_TICK_S``, and at once when the API pushes to the wake list):

1. reconcile: every starting/running job is compared with its Ray job's status. Ray RUNNING moves
   ``starting -> running``; SUCCEEDED/FAILED/STOPPED end it; a Ray job that Ray no longer knows
   (the cluster restarted) goes back to the queue to resume from its checkpoint, or fails after
   ``TLAB_MAX_ATTEMPTS``; a cancel request stops the Ray job (SIGTERM, SIGKILL after the grace), and so
   does a running job's time limit (``service.rules.limits``: it then ends failed, its last checkpoint kept) and a
   preemption (``service.scheduler.preempt``: once stopped, it goes back to the queue with its age).
2. dispatch: ``policy.decide`` picks what starts; each is moved ``queued -> starting`` with its
   Ray submission id *before* the submit, so a scheduler killed in between finds it in ``starting``
   and submits the same id again (Ray refuses duplicates): no job is lost or started twice. The job that
   waits first for room may then preempt running jobs of lower priority (``service.rules.victims``).

Only the holder of the Redis lock schedules; a second scheduler waits until the lock expires.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import redis
from redis.exceptions import LockError

from api_schemas import keys
from api_schemas.jobs import Demand, JobState
from api_schemas.reasons import FAILURE_MARK, one_line
from service.core import retention, storage_lifecycle
from service.core.errors import Unstartable
from service.core.settings import Settings
from service.core.signals import stop_on_signals
from service.core.storage import check_or_exit
from service.core.store import Store, redact_url
from service.launch.job_acl import JobAcl
from service.launch.job_env import job_env
from service.launch.preflight_jobs import PreflightJobs
from service.launch.ray_cluster import RAY_ACTIVE, RAY_DONE, ClusterSource, RayJobs, RayNodes, StaticCluster
from service.launch.ray_reasons import last_error, reason_from_ray
from service.rules import after as dependencies
from service.rules import policy
from service.rules.limits import (
    STORAGE_LIMITED,
    TIME_LIMITED,
    StorageWatch,
    over_limit,
    storage_over,
    time_limit_reason,
)
from service.rules.policy import ActiveJob, Node, QueuedJob
from service.scheduler import deaths, leaving
from service.scheduler import preempt as preempting
from service.scheduler.cluster_view import cluster_view, gpu_memory
from service.scheduler.notify import Sender
from service.scheduler.preflight import Preflights
from service.scheduler.repeated import RepeatedErrors
from service.scheduler.trackers import Trackers

log = logging.getLogger("tlab.scheduler")
ENTRYPOINT = {"experiment": "workers.run", "sweep": "workers.sweep"}  # job kind -> the module its Ray job runs


class Launcher(Protocol):
    def submission_id(self, job_id: str, attempt: int) -> str: ...
    def submit(self, job_id: str, submission_id: str, module: str = ..., demand: Demand | None = None,
               placement: Sequence[str] = ()) -> None: ...
    def status(self, submission_id: str) -> str | None: ...
    def message(self, submission_id: str) -> str: ...
    def exit_code(self, submission_id: str) -> int | None: ...
    def stop(self, submission_id: str) -> None: ...


class Scheduler:
    def __init__(self, store: Store, settings: Settings, cluster: ClusterSource, launcher: Launcher,
                 acl: JobAcl | None = None, preflights: Preflights | None = None) -> None:
        self.store, self.settings, self.cluster, self.launcher = store, settings, cluster, launcher
        self.acl = acl  # the jobs' own Redis users (service.launch.job_acl); made by the launcher's submit
        self.preflights = preflights  # user code is tried on one CPU before its gang (service.scheduler.preflight)
        self.static: dict[str, QueuedJob] = {}  # queued jobs' immutable fields, read once
        self.last_charge = time.time()
        self.holding: list[ActiveJob] | None = None  # the gangs held since last_charge: what the next charge bills
        self.decisions = 0
        self.requeued_at = 0.0  # when a preempted job last went back to the queue (service.scheduler.preempt.SETTLE_S)
        self.expired_at = 0.0  # when ended jobs were last looked at for TLAB_HISTORY_DAYS (service.core.retention)
        self.storage = StorageWatch(settings.storage_check_s)  # when each running job's files were last measured
        self.leaving: set[str] = set()  # ids of the nodes leaving (`tlab leave`): planned without (leaving.py)

    # ---- reading Redis -----------------------------------------------------------------------
    def queued(self) -> list[QueuedJob]:
        ids = self.store.r.zrange(keys.queue(), 0, -1)
        missing = [i for i in ids if i not in self.static]
        if missing:
            pipe = self.store.r.pipeline(transaction=False)
            for job_id in missing:
                pipe.hmget(keys.job(job_id), ["owner", "priority", "created_at", "demand", "after"])
            for job_id, (owner, prio, created, demand, after) in zip(missing, pipe.execute(), strict=True):
                if owner is not None:
                    self.static[job_id] = QueuedJob(job_id, owner, int(prio), float(created),
                                                    Demand.model_validate_json(demand),
                                                    tuple(json.loads(after or "[]")))
        keep = set(ids)
        self.static = {k: v for k, v in self.static.items() if k in keep}
        return [self.static[i] for i in ids if i in self.static]

    def active(self) -> list[dict[str, str]]:
        return self.store.raws(sorted(self.store.r.smembers(keys.active())))

    as_active = staticmethod(preempting.active_job)

    # ---- 1. reconcile ------------------------------------------------------------------------
    def reconcile(self, now: float) -> None:
        before = self.active()
        for data in before:
            try:
                self.reconcile_one(data, now)
            except Exception:  # one job's Ray trouble must not stop the others being reconciled
                log.exception("reconciling %s", data.get("id"))
        storage_lifecycle.settle(self.store, self.settings, before)  # those that ended: one checkpoint kept
        self.storage.keep({d["id"] for d in before})

    def reconcile_one(self, data: dict[str, str], now: float) -> None:
        job_id, state, sid = data["id"], JobState(data["state"]), data.get("ray_job_id", "")
        status = self.launcher.status(sid) if sid else None
        if self.acl and status in RAY_DONE:
            self.acl.keep_summary(job_id)  # what the job wrote in its own copy (service.launch.job_acl), before it ends
        cancel = bool(data.get("cancel_requested"))
        active = [JobState.STARTING, JobState.RUNNING]
        if cancel and status in RAY_ACTIVE:
            self.launcher.stop(sid)  # Ray reports STOPPED once the process is gone; then it is cancelled
            return
        limit = data.get(TIME_LIMITED) or data.get(STORAGE_LIMITED) or self.check_limit(data, status, now)
        if limit and not cancel and status != "SUCCEEDED":  # a job that finished within its grace succeeded
            if status in RAY_ACTIVE:
                self.launcher.stop(sid)  # SIGTERM: the driver exports its artifacts; SIGKILL after the grace
            else:
                reason = data.get(STORAGE_LIMITED) or time_limit_reason(self.store, job_id, float(limit))
                self.store.transition(job_id, JobState.FAILED, expect=active, reason=reason, failure_reason=reason,
                                      now=now)
            return
        if not cancel and preempting.settling(data, status):
            if status in RAY_ACTIVE:
                self.launcher.stop(sid)  # SIGTERM again is harmless: Ray's supervisor stops a job once
            elif preempting.requeue(self.store, data, now):
                self.requeued_at = now
            return
        if status is None:
            if cancel:
                self.store.transition(job_id, JobState.CANCELLED, expect=active, reason="cancelled by user", now=now)
            elif state == JobState.STARTING:
                # killed between the transition and the submit: the same id again
                job = self.as_active(data)
                try:
                    self.launcher.submit(job_id, sid, ENTRYPOINT[data.get("kind", "experiment")], job.demand,
                                         job.placement)
                except Unstartable as err:  # as at the first submit (launch): it would stay starting for good
                    self.store.transition(job_id, JobState.FAILED, expect=[state], now=now, reason=str(err),
                                          failure_reason=str(err))
            else:
                deaths.retry_or_fail(self.store, self.settings, data, "its Ray job vanished (cluster restarted?)",
                                     now)
        elif (status == "PENDING" and state == JobState.STARTING
              and now - float(data.get("updated_at") or now) > self.settings.starting_timeout_s):
            self.launcher.stop(sid)
            reason = (f"Ray did not start the job within TLAB_STARTING_TIMEOUT_S="
                      f"{self.settings.starting_timeout_s:g} s (runtime environment or resources?)")
            self.store.transition(job_id, JobState.FAILED, expect=[state], reason=reason, failure_reason=reason,
                                  now=now)
        elif status == "RUNNING" and state == JobState.STARTING:
            self.store.transition(job_id, JobState.RUNNING, expect=[JobState.STARTING], now=now,
                                  started_at=repr(now))
        elif status == "SUCCEEDED":
            self.store.transition(job_id, JobState.SUCCEEDED, expect=active, now=now)
        elif status == "FAILED":
            # one line: the worker's error event, else what Ray says (Ray asked only when needed)
            said = last_error(self.store, job_id)
            message = "" if said else self.launcher.message(sid)
            if not said and FAILURE_MARK not in message and not cancel and deaths.died(
                    self.store, self.settings, data, self.launcher.exit_code(sid), now):
                return
            reason = one_line(said or reason_from_ray(message) or "the Ray job failed")
            self.store.transition(job_id, JobState.FAILED, expect=active, reason=reason, failure_reason=reason,
                                  now=now)
        elif status == "STOPPED":
            if cancel:
                self.store.transition(job_id, JobState.CANCELLED, expect=active, reason="cancelled by user", now=now)
            else:
                reason = "its Ray job was stopped outside Teleport Lab"
                self.store.transition(job_id, JobState.FAILED, expect=active, reason=reason, failure_reason=reason,
                                      now=now)

    def check_limit(self, data: dict[str, str], status: str | None, now: float) -> str:
        """Mark a running job that reached its time limit (the limit, as the mark) or whose files are over their
        limit (the reason, as the mark: ``service.rules.limits.storage_over``); '' if neither."""
        limit = over_limit(self.settings, data, now) if status in RAY_ACTIVE else None
        if limit is None:
            return self.check_storage(data, status, now)
        log.info("%s reached its time limit of %g s: stopping it (grace %g s)", data["id"], limit,
                 self.settings.stop_grace_s)
        self.store.r.hset(keys.job(data["id"]), TIME_LIMITED, repr(limit))
        return repr(limit)

    def check_storage(self, data: dict[str, str], status: str | None, now: float) -> str:
        """Every ``TLAB_STORAGE_CHECK_S`` per running job: its files measured, and marked when over a limit."""
        job_id = data["id"]
        if status not in RAY_ACTIVE or data.get("state") != JobState.RUNNING.value or not self.storage.due(job_id, now):
            return ""
        size, entries = storage_lifecycle.job_usage(self.settings, job_id, self.settings.max_job_files)
        reason = storage_over(self.settings, self.store, data, size, entries)
        if reason:
            log.info("%s: %s", job_id, reason)
            self.store.r.hset(keys.job(job_id), STORAGE_LIMITED, reason)
        return reason

    # ---- 2. dispatch -------------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        return self.cluster.nodes()

    def lost(self) -> list[Node]:
        """The nodes Ray declared dead as of the last ``nodes`` (``RayNodes.lost``; none for a static cluster)."""
        return list(getattr(self.cluster, "lost", list)())

    def planned(self, nodes: list[Node]) -> list[Node]:
        """The nodes to plan with: all but those leaving (a node leaving takes nothing new)."""
        return [n for n in nodes if n.id not in self.leaving]

    def decide(self, now: float, nodes: list[Node] | None = None
               ) -> tuple[policy.Decision, list[Node], list[ActiveJob]]:
        nodes = self.nodes() if nodes is None else nodes
        planned = self.planned(nodes)
        active = [self.as_active(d) for d in self.active()]
        quotas = {u.name: u.quotas for u in self.store.users()}
        usage = self.store.usage(now, self.settings.half_life_s)
        queued = self.queued()
        blocked, gone = dependencies.settle(self.store, queued, now)  # fails those whose dependency failed
        queued, free_nodes = [q for q in queued if q.id not in gone], planned
        if self.preflights:  # a job running user code waits until its preflight passed; the preflights' CPUs held
            blocked = {**self.preflights.step(queued, planned, active, now), **blocked}
            free_nodes = self.preflights.hold(planned)
        full = storage_lifecycle.disk_reason(self.settings)  # TLAB_MIN_FREE_GB: nothing starts on a full disk
        blocked = {**{q.id: full for q in queued}, **blocked} if full else blocked
        decision = policy.decide(queued, active, free_nodes, usage, quotas, self.settings.start_charge_s,
                                 blocked=blocked)
        self.decisions += 1
        return decision, nodes, active

    def dispatch(self, now: float, nodes: list[Node] | None = None) -> policy.Decision:
        decision, nodes, active = self.decide(now, nodes)
        if self.holding is None:  # this scheduler's first dispatch: the jobs running now held their gangs before it
            self.holding = list(active)
        charges: dict[str, float] = {}
        for job, placement in decision.starts:
            attempts, kind, resumed = self.store.r.hmget(keys.job(job.id), ["attempts", "kind", "resume_free"])
            attempt = int(attempts or 0) + 1
            sid = self.launcher.submission_id(job.id, attempt)
            refusal = self.acl.refusal(job.id) if self.acl else ""
            if refusal:  # user code that Redis cannot isolate (TLAB_JOB_REDIS_ACL): it must not start
                self.store.transition(job.id, JobState.FAILED, expect=[JobState.QUEUED], now=now, reason=refusal,
                                      failure_reason=refusal)
                continue
            if not self.store.transition(job.id, JobState.STARTING, expect=[JobState.QUEUED], now=now,
                                         ray_job_id=sid, attempts=str(attempt), placement=json.dumps(placement),
                                         pending_reason="", resume_free=""):
                continue  # cancelled meanwhile
            self.static.pop(job.id, None)
            if not self.launch(job, attempt, kind, placement, now, resumed or ""):
                continue
            if not resumed:  # a job resuming after a preemption paid its start charge when it first started
                charges[job.owner] = (charges.get(job.owner, 0.0)
                                      + policy.weight(job.demand) * self.settings.start_charge_s)
            active.append(ActiveJob(job.id, job.owner, job.demand, tuple(placement)))
        self.charge_running(active, now, charges)
        preempting.preempt(self.store, self.launcher, self.settings, decision, self.planned(nodes), active, now,
                           self.requeued_at)
        self.publish(decision, nodes, active, now)
        return decision

    def launch(self, job: QueuedJob, attempt: int, kind: str | None, placement: list[str], now: float,
               resume_free: str = "") -> bool:
        """Submit the starting job to Ray. A job that can never start as stored fails at once; one Ray refused
        (or Ray is down) goes back to the queue for the next tick, its attempt not counted and a preempted job's
        ``resume_free`` kept (its start charge is still paid)."""
        try:
            sid = self.launcher.submission_id(job.id, attempt)
            self.launcher.submit(job.id, sid, ENTRYPOINT[kind or "experiment"], job.demand, placement)
            return True
        except Unstartable as err:
            self.store.transition(job.id, JobState.FAILED, expect=[JobState.STARTING], now=now, reason=str(err),
                                  failure_reason=str(err))
        except Exception as err:
            log.exception("submitting %s", job.id)
            self.store.transition(job.id, JobState.QUEUED, expect=[JobState.STARTING], now=now,
                                  reason=f"Ray did not accept the job ({err}); will retry",
                                  attempts=str(attempt - 1), resume_free=resume_free)
        return False

    def charge_running(self, active: list[ActiveJob], now: float, charges: dict[str, float]) -> None:
        """Fair share: the time since the last charge is billed to the gangs held over it (a job started at this
        tick has held nothing yet; one that ended or went back to the queue since held its gang until this tick
        saw it go), plus ``charges`` (start charges); ``active`` holds theirs from now on."""
        dt = max(0.0, now - self.last_charge)
        for job in self.holding or []:
            charges[job.owner] = charges.get(job.owner, 0.0) + policy.weight(job.demand) * dt
        self.last_charge, self.holding = now, list(active)
        self.store.charge(charges, now, self.settings.half_life_s)

    def publish(self, decision: policy.Decision, nodes: list[Node], active: list[ActiveJob], now: float) -> None:
        """Queue positions and reasons, and the cluster view, for the API to show."""
        view = cluster_view(nodes, active, gpu_memory(self.store, active),  # per node: totals, free, each job's share
                            self.lost(), self.leaving)
        pipe = self.store.r.pipeline(transaction=True)
        pipe.delete(keys.queue_view())
        if decision.order:
            pipe.hset(keys.queue_view(), mapping={
                job_id: json.dumps({"position": i + 1, "reason": why})
                for i, (job_id, why) in enumerate(decision.order)})
        pipe.set(keys.cluster(), json.dumps({"view": view.model_dump(), "at": now}))
        pipe.execute()

    def evict(self, nodes: list[Node], now: float) -> None:
        """Stop the jobs placed on a node leaving (``leaving.py``) or lost (``preempt.py``): they resume elsewhere."""
        active = [self.as_active(d) for d in self.active()]
        self.leaving = leaving.evict_from_leaving_nodes(self.store, self.launcher, nodes, active, now)
        preempting.evict_from_lost_nodes(self.store, self.launcher, nodes, active, now,
                                         {n.id: n.label for n in self.lost()})

    def tick(self) -> None:
        now = time.time()
        # before reconcile: a job whose driver died with its node may already show FAILED in Ray this tick
        nodes = self.nodes()
        self.evict(nodes, now)
        self.reconcile(now)
        if now - self.expired_at >= retention.EXPIRE_EVERY_S:  # TLAB_HISTORY_DAYS: old ended jobs go, with their files
            self.expired_at = now
            try:
                retention.expire(self.store, self.settings, now)
                retention.expire_code(self.store, self.settings, now)  # TLAB_CODE_TTL_DAYS: packages no job uses
            except OSError:  # storage trouble must not hold up this tick's dispatch; the next pass tries again
                log.exception("expiring old jobs and code packages")
        if self.acl:
            self.acl.sync()  # users of jobs that ended or went back to the queue go; lost ones come back
        self.dispatch(time.time(), nodes)


def build(settings: Settings) -> Scheduler:
    from service.core.code_store import JobCode

    store = Store.from_url(settings.redis_url)
    cluster: ClusterSource = (StaticCluster(settings.cluster_nodes) if settings.cluster_nodes
                              else RayNodes(settings.ray_address))
    acl = JobAcl(store.r, settings)
    code = JobCode(settings, store.r)
    jobs = RayJobs(settings.ray_address, job_env(settings), code=code,  # + the job's package
                   credentials=acl.credentials)  # + its own Redis user
    preflights = Preflights(store, settings, PreflightJobs(settings.ray_address, job_env(settings)), acl, code)
    return Scheduler(store, settings, cluster, jobs, acl, preflights)


RAY_WAIT_SAY_S = 30.0  # while Ray does not answer at start, the scheduler says so this often


def ray_answers(address: str) -> None:
    """Raise ConnectionError unless Ray's dashboard answers HTTP at ``address`` (any status: it is up)."""
    import httpx

    try:
        httpx.get(f"{address.rstrip('/')}/api/version", timeout=5)
    except httpx.HTTPError as err:
        raise ConnectionError(f"no answer from Ray's dashboard at {address}: {err}") from err


def build_when_ray_answers(settings: Settings, stop: threading.Event) -> Scheduler | None:
    """``build`` once Ray's dashboard answers (a head still starting, or restarting): the scheduler waits for it,
    saying so every ``RAY_WAIT_SAY_S``, rather than exiting; None when stopped first."""
    waited, said = time.monotonic(), 0.0
    while not stop.is_set():
        try:
            if not settings.cluster_nodes:
                ray_answers(settings.ray_address)  # at once, where Ray's own client retries for half a minute
            return build(settings)
        except (ConnectionError, RuntimeError, OSError, redis.ConnectionError) as err:  # no answer from Ray (or Redis)
            if time.monotonic() - said >= RAY_WAIT_SAY_S:
                said = time.monotonic()
                log.warning("waiting for Ray at %s (%.0f s so far; RAY_ADDRESS): %s", settings.ray_address,
                            said - waited, str(err).splitlines()[0][:200])
            stop.wait(1.0)
    return None


def serve(settings: Settings) -> None:
    """Hold the lock and tick until SIGTERM/SIGINT; the wake list cuts the wait short."""
    stop = stop_on_signals()
    scheduler = build_when_ray_answers(settings, stop)
    if scheduler is None:
        return
    r = scheduler.store.r
    lock_ttl = max(15.0, 5 * settings.tick_s)  # longer than a slow tick (a Ray submit can take 10 s)
    lock = r.lock(keys.scheduler_lock(), timeout=lock_ttl, thread_local=False)

    def take_lock() -> None:
        while not stop.is_set() and not lock.acquire(blocking=True, blocking_timeout=1.0):
            pass

    log.info("scheduler waiting for the lock")
    take_lock()
    log.info("scheduler holds the lock; Redis %s, Ray %s", redact_url(settings.redis_url), settings.ray_address)
    sender = Sender(scheduler.store, settings).start()  # webhooks from their own threads: a tick never waits
    trackers = Trackers(scheduler.store, settings).start()  # TensorBoard files, MLflow runs: their own thread too
    quiet = RepeatedErrors(log)
    try:
        while not stop.is_set():
            try:
                scheduler.tick()
                lock.reacquire()
            except LockError:  # the lock expired (a long tick, a Redis restart): take it again first
                log.warning("lost the scheduler lock; waiting to take it again")
                take_lock()
                continue
            except redis.ConnectionError:
                log.warning("Redis unreachable; retrying")
                time.sleep(settings.tick_s)
                continue
            except Exception as err:
                quiet.report(err)
            try:
                scheduler.store.wait_wake(settings.tick_s)
            except (redis.ConnectionError, redis.TimeoutError):  # Redis went away mid-wait: the next tick says so
                time.sleep(settings.tick_s)
    finally:
        sender.stop()
        trackers.stop()
        try:
            lock.release()
        except Exception:
            pass


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s",
                        stream=sys.stderr)
    settings = Settings()
    check_or_exit(settings)  # a malformed TLAB_STORAGE URI or an unreachable bucket: one line, exit 2
    serve(settings)
    return 0

