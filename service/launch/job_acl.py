"""A Redis ACL user per job: a job's processes (and the user's code in them) reach Redis only as
``tlab-job-<id>``, allowed exactly the job's own keys (``keys.own_keys``: its events stream, emitted, trials, ``run``
and preflight hashes; no pattern, so no other key under ``tlab:job:<id>:``) and the commands the workers use, never
with the service's own ``REDIS_URL`` (docs/operations.md, "Isolation between jobs"). Not the job hash
``tlab:job:<id>`` itself: the scheduler and the API trust its owner, state, demand, priority, Ray submission id and
``id``; the job reads a copy of its inputs and writes its summary in ``keys.job_run`` (workers/job/record.py), which
``keep_summary`` copies back once the Ray job has ended.

The workers write through the bounded scripts of ``api_schemas.redis_scripts`` (``xadd_once``, ``hset_own``), with the
caps of ``TLAB_JOB_REDIS_MB`` in their text: an entry over its cap, or a write that would take the job's keys over its
share, is refused before it lands. Redis checks a script's calls against the user that runs it, so the user holds the
raw ``XADD``/``HSET``/``HSETNX`` those scripts call: a job's own code can still write raw into its own keys, which
the scheduler's tick measures (``service.launch.job_caps``), with Redis's ``maxmemory`` behind it.

- ``credentials(job_id, submission_id)``, called by ``RayJobs.submit`` right before each submit: loads the bounded
  scripts, also fenced to the job's current attempt (``workers.job.fence``; the user may run only scripts the
  service loaded: ``EVALSHA``, no ``EVAL``/``SCRIPT LOAD``), copies the job's inputs and the scripts' caps into
  ``keys.job_run`` (exactly, each time: ``copy_inputs``), makes the user (``ACL SETUSER name reset ...``: exactly
  these rules) and returns a one-time ticket to the job's ``REDIS_URL``, never the URL
  itself: the Ray job's ``runtime_env`` is readable by every job's code (Ray's Jobs API with the cluster's token). The
  ticket (``TLAB_JOB_TICKET``) is the URL of a second user, ``tlab-ticket-job-<id>``, allowed nothing but ``GETDEL`` of
  one key, ``keys.ticket``, which holds the job's ``REDIS_URL``: the job's first process redeems it at start
  (workers/job/ticket.py) and from then on the ticket opens nothing; a ticket someone else redeemed first makes the job
  fail at start, saying so. Both passwords are HMAC(a secret kept in Redis, the Ray submission id): a scheduler that
  died between making the users and submitting gives the same submission id the same ones when it submits again, and
  each attempt (a resume after a preemption or a lost Ray job) new ones.
- ``sync()``, each tick after reconcile: deletes the users of jobs no longer starting or running (ended, cancelled,
  preempted back to the queue, a dead scheduler's leftovers; Redis disconnects their clients) and their ticket
  users (and those already redeemed), and makes again those of active jobs that Redis lost (a restarted Redis keeps
  no ACL users); a deleted user's ``run`` copy and unredeemed ticket go with it; and takes the writes of a job
  over its share of Redis (``service.launch.job_caps``, ``TLAB_JOB_REDIS_MB``).
- ``drop_users(r, job_id)``: the job's users and ticket users deleted at once (Redis closes their connections),
  when the job itself is deleted.
- ``refusal(job_id)``: with ``TLAB_JOB_REDIS_ACL=on`` but a Redis without ACL (older than 6.2, or the service's
  user may not run ``ACL``), a job that runs the user's code is refused rather than given full rights; an admin
  who accepts that sets ``TLAB_JOB_REDIS_ACL=off``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

from api_schemas import keys
from api_schemas.redis_scripts import fence_check, hset_own, write_caps, xadd_once
from api_schemas.spec import ExperimentSpec
from service.core.settings import Settings
from service.launch import job_caps
from service.launch.redis_users import TICKET_PREFIX, USER_PREFIX, preflight_user, ticket_user, user_name

log = logging.getLogger("tlab.scheduler")
INPUTS = ("spec", "sweep", "start_from", "attempts")  # what workers/ reads of its job (workers.job.record)
# what workers/ sends (EVALSHA of the bounded scripts, whose own calls Redis checks against the user too: XADD,
# HSETNX, HSET, HSTRLEN, MEMORY USAGE; DEL of its trials by a sweep's driver), a few reads of the same keys, PING,
# SELECT for a non-zero db, and ACL WHOAMI (who it is)
COMMANDS = ("ping", "select", "hget", "hmget", "hgetall", "hvals", "hstrlen", "hset", "hsetnx", "del", "xadd",
            "xrange", "xrevrange", "evalsha", "memory|usage", "acl|whoami")


def rules(job_id: str, password: str) -> list[str]:
    """``ACL SETUSER`` arguments: nothing but the job's own keys, each by its exact name, and ``COMMANDS``, whatever
    the user had before."""
    return ["reset", "on", f">{password}", *(f"~{keys.glob_escape(k)}" for k in keys.own_keys(job_id)), "-@all",
            *(f"+{c}" for c in COMMANDS)]


def ticket_rules(ticket: str, password: str) -> list[str]:
    """``ACL SETUSER`` arguments of a ticket user: ``GETDEL`` of its one key (and ``SELECT`` for a non-zero db)."""
    return ["reset", "on", f">{password}", f"~{keys.ticket(ticket)}", "-@all", "+getdel", "+select"]


def job_url(service_url: str, user: str, password: str) -> str:
    """The service's Redis URL with the job's user and password instead of the service's credentials."""
    parts = urlsplit(service_url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k not in ("username", "password")]
    where = parts.netloc.rsplit("@", 1)[-1]
    if parts.scheme == "unix":  # unix:///path/to/redis.sock?db=0&username=...&password=...
        return f"unix://{where}{parts.path}?{urlencode([*query, ('username', user), ('password', password)])}"
    return urlunsplit((parts.scheme, f"{user}:{password}@{where}", parts.path, urlencode(query), ""))


def probe(r: redis.Redis) -> str:
    """'' when this Redis lets the service manage ACL users, else why not (in words)."""
    name = f"{USER_PREFIX}probe"
    try:  # a ticket user's rules: GETDEL came with Redis 6.2
        r.execute_command("ACL", "SETUSER", name, "reset", "off", "-@all", "+getdel")
        r.execute_command("ACL", "DELUSER", name)
    except redis.ResponseError as err:
        return f"Redis answers ACL with {str(err).splitlines()[0][:120]!r}; job users need Redis >= 6.2"
    return ""


def open_default_user(r: redis.Redis) -> bool:
    """Redis's ``default`` user is on and needs no password: anyone reaching the port has full rights."""
    try:
        user = r.acl_getuser("default") or {}
    except redis.ResponseError:
        return False
    flags = {f.decode() if isinstance(f, bytes) else str(f) for f in user.get("flags", [])}
    return {"on", "nopass"} <= flags


class JobAcl:
    """The scheduler's per-job Redis users (module doc); ``r``: the service's own connection."""

    def __init__(self, r: redis.Redis, settings: Settings) -> None:
        self.r, self.settings = r, settings
        self.unsupported: str | None = None  # why Redis has no ACL for us ('' = it has); None: not asked yet
        self.clamped: set[str] = set()  # active jobs whose writes were taken for going over TLAB_JOB_REDIS_MB

    @property
    def isolated(self) -> bool:
        """Jobs get users of their own: the setting is on and Redis allows it (asked once, at first use)."""
        if self.unsupported is None:
            self.unsupported = probe(self.r)
            self.warn()
        return self.settings.job_redis_acl and not self.unsupported

    def warn(self) -> None:
        if not self.settings.job_redis_acl:
            log.warning("TLAB_JOB_REDIS_ACL=off: jobs get the service's own REDIS_URL; a job's code can read and "
                        "change every job's and user's data in Redis")
        elif self.unsupported:
            log.warning("no Redis ACL (%s): jobs without user code get the service's REDIS_URL, jobs with user code "
                        "are refused (TLAB_JOB_REDIS_ACL=off runs them with full Redis rights)", self.unsupported)
        elif open_default_user(self.r):
            log.warning("Redis's default user needs no password: a job's code could connect without its "
                        "credentials and get full rights; give Redis a password (requirepass; tlab up does)")

    def password(self, submission_id: str) -> str:
        self.r.set(keys.acl_secret(), secrets.token_hex(32), nx=True)
        secret = self.r.get(keys.acl_secret())
        raw = secret.encode() if isinstance(secret, str) else bytes(secret or b"")
        return hmac.new(raw, submission_id.encode(), hashlib.sha256).hexdigest()

    def create(self, job_id: str, submission_id: str, user: str = "") -> str:
        """Make (or make again, the same) the job's user for this submission: its password. ``user``: another
        name for it (a preflight's, which ``sync`` leaves alone: ``service.scheduler.preflight``)."""
        password = self.password(submission_id)
        caps = write_caps(self.settings.job_redis_mb)
        self.copy_inputs(job_id, caps)
        attempt = int(self.r.hget(keys.job(job_id), "attempts") or 1)  # what the job pins (workers.job.fence)
        for script in (xadd_once(caps), hset_own(caps), xadd_once(caps, attempt), hset_own(caps, attempt),
                       fence_check(attempt)):  # before the user exists: it never needs SCRIPT LOAD
            self.r.script_load(script)
        self.r.execute_command("ACL", "SETUSER", user or user_name(job_id), *rules(job_id, password))
        return password

    def copy_inputs(self, job_id: str, caps: tuple[int, int]) -> None:
        """The job's inputs (``INPUTS``) and the scripts' caps copied into its run copy, exactly: every input written
        again, one the job hash lacks deleted (the job's user may write the copy: a field it planted there, a
        ``start_from`` say, never survives a resume or a restore), in one ``MULTI`` against the job hash as read."""
        job, run = keys.job(job_id), keys.job_run(job_id)

        def copy(pipe: Any) -> None:
            inputs = {k: v for k, v in zip(INPUTS, pipe.hmget(job, list(INPUTS)), strict=True) if v}
            pipe.multi()
            pipe.hdel(run, *INPUTS)
            pipe.hset(run, mapping={keys.JOB_RUN_MARK: job_id, **inputs,  # what the job may read
                                    keys.JOB_RUN_CAPS: ",".join(map(str, caps))})

        self.r.transaction(copy, job)  # (WATCHed: a job hash changed meanwhile is read and copied again)

    def credentials(self, job_id: str, submission_id: str, user: str = "") -> dict[str, str]:
        """The job's environment overrides: the one-time ticket to its own ``REDIS_URL`` (none when jobs are not
        isolated); the service's ``REDIS_URL`` must not go with it (``service.launch.ray_cluster.with_credentials``)."""
        if not self.isolated:
            return {}
        name = user or user_name(job_id)
        password = self.create(job_id, submission_id, user)
        self.r.set(keys.ticket(ticket_user(name)), job_url(self.settings.redis_url, name, password))
        return {keys.JOB_TICKET_ENV: self.make_ticket(name, submission_id)}

    def make_ticket(self, name: str, submission_id: str) -> str:
        """Make (or make again, the same) the ticket user of the user ``name``'s submission: the ticket's URL."""
        ticket, password = ticket_user(name), self.password(f"ticket:{submission_id}")
        self.r.execute_command("ACL", "SETUSER", ticket, *ticket_rules(ticket, password))
        return job_url(self.settings.redis_url, ticket, password)

    def restore(self, job_id: str, submission_id: str, user: str = "") -> None:
        """A user Redis lost made again, the same; its ticket user too while its ticket is not redeemed."""
        name = user or user_name(job_id)
        self.create(job_id, submission_id, user)
        if self.r.exists(keys.ticket(ticket_user(name))):
            self.make_ticket(name, submission_id)

    def sync(self) -> None:
        """Delete the users of jobs not starting/running; make again the missing users of those that are."""
        isolated = self.isolated
        if self.unsupported:
            return
        try:
            have = {u.decode() if isinstance(u, bytes) else str(u) for u in self.r.acl_users()}
            ids = sorted(self.r.smembers(keys.active()))
            pipe = self.r.pipeline(transaction=False)
            for job_id in ids:
                pipe.hget(keys.job(job_id), "ray_job_id")
            active = {user_name(str(i)): (str(i), sid) for i, sid in zip(ids, pipe.execute(), strict=True) if sid}
            for name in sorted(n for n in have if n.startswith(USER_PREFIX) and n not in active):
                self.r.execute_command("ACL", "DELUSER", name)
                self.r.delete(keys.job_run(name.removeprefix(USER_PREFIX)))
            self.drop_tickets(sorted(n for n in have if n.startswith(TICKET_PREFIX + "job-")), active)
            for name, (job_id, sid) in sorted(active.items()):
                if isolated and name not in have:
                    log.info("making Redis user %s again (Redis restarted?)", name)
                    self.restore(job_id, sid.decode() if isinstance(sid, bytes) else str(sid))
                    self.clamped.discard(job_id)  # made again with its writes: checked again below
            if isolated:  # a job over its share of Redis loses its writes (service.launch.job_caps)
                self.clamped &= {job_id for job_id, _sid in active.values()}
                job_caps.enforce(self.r, {job_id: name for name, (job_id, _sid) in active.items()},
                                 int(self.settings.job_redis_mb * 2**20), self.clamped)
        except redis.ResponseError:  # a Redis that stopped allowing ACL: the next tick tries again
            log.exception("syncing the jobs' Redis users")

    def drop_tickets(self, tickets: list[str], active: dict[str, Any]) -> None:
        """Delete the ticket users of jobs no longer active (with their unredeemed tickets) and those redeemed."""
        pipe = self.r.pipeline(transaction=False)
        for ticket in tickets:
            pipe.exists(keys.ticket(ticket))
        for ticket, unredeemed in zip(tickets, pipe.execute(), strict=True):
            if not unredeemed or "tlab-" + ticket.removeprefix(TICKET_PREFIX) not in active:
                self.r.execute_command("ACL", "DELUSER", ticket)
                self.r.delete(keys.ticket(ticket))

    def keep_summary(self, job_id: str) -> None:
        """Once the job's Ray job has ended: the summary it wrote in its copy, into the job hash (the API's)."""
        summary = self.r.hget(keys.job_run(job_id), "summary")
        if summary and _json_object(summary):  # the job wrote it: anything else would break the API's views
            self.r.hset(keys.job(job_id), "summary", summary)

    def refusal(self, job_id: str) -> str:
        """Why a queued job must not start (user code that could not be isolated), or ''."""
        if self.isolated or not self.settings.job_redis_acl:
            return ""
        raw = self.r.hget(keys.job(job_id), "spec")
        try:
            uses = ExperimentSpec.model_validate_json(raw).user_code_fields() if raw else []
        except ValueError:  # a stored spec that no longer validates: the worker says so in its own words
            uses = []
        if not uses:
            return ""
        return ("this job runs your code, and the service cannot give it a Redis user of its own "
                f"({self.unsupported}): an admin may set TLAB_JOB_REDIS_ACL=off to run such jobs with the service's "
                "full Redis rights")


def drop_users(r: redis.Redis, job_id: str) -> None:
    """Delete the job's Redis users (its own, its preflight's) and their ticket users and tickets; Redis closes their
    connections. Nothing to do where Redis has no ACL."""
    names = [user_name(job_id), preflight_user(job_id)]
    names += [ticket_user(n) for n in names]
    try:
        r.execute_command("ACL", "DELUSER", *names)
    except redis.ResponseError:  # no ACL here (older than 6, or the service may not run it): no users were made
        pass
    r.delete(*(keys.ticket(n) for n in names[2:]))


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
