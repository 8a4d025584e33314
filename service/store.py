"""The Redis store: jobs, users and tokens, usage, idempotency. Every state change is one Lua call."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Iterable
from typing import Any

import redis

from api_schemas import keys
from api_schemas.jobs import (
    ACTIVE,
    TERMINAL,
    Demand,
    ExperimentSubmit,
    JobState,
    JobView,
    Progress,
    Quotas,
    Role,
    UserCreate,
    UserPublic,
)
from api_schemas.redis_scripts import SUBMIT, TRANSITION
from api_schemas.sweeps import SweepSubmit
from service.errors import IdempotencyConflict, InvalidState, JobNotFound, Unauthorized, UserExists

IDEMPOTENCY_TTL_S = 24 * 3600


def new_job_id(now: float) -> str:
    """Sortable by creation time (hex milliseconds) with 24 random bits: ``18f3a2b4c5d-9e1f2a``."""
    return f"{int(now * 1000):011x}-{secrets.token_hex(3)}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def demand_of(submit: ExperimentSubmit | SweepSubmit) -> Demand:
    """An experiment's gang is its workers; a sweep's is its workers times the trials run at once."""
    if isinstance(submit, SweepSubmit):
        r, concurrent = submit.base.resources, submit.max_concurrent_trials
    else:
        r, concurrent = submit.spec.resources, 1
    return Demand(workers=r.workers * concurrent, cpus_per_worker=r.cpus_per_worker,
                  gpus_per_worker=r.gpus_per_worker)


def _opt_float(value: str | None) -> float | None:
    return float(value) if value not in (None, "") else None


class Store:
    """Jobs, users and usage in Redis (``decode_responses=True``); safe to share between threads."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._submit = client.register_script(SUBMIT)
        self._transition = client.register_script(TRANSITION)

    @classmethod
    def from_url(cls, url: str) -> Store:
        return cls(redis.Redis.from_url(url, decode_responses=True, health_check_interval=30))

    # ---- jobs -------------------------------------------------------------------------------
    def submit(self, owner: str, body: ExperimentSubmit | SweepSubmit, idempotency_key: str | None = None,
               now: float | None = None) -> tuple[str, bool, int, float]:
        """Queue a job: (id, created, queue length, created_at). A repeated Idempotency-Key with the same
        body returns the original id with created=False; with another body it raises IdempotencyConflict."""
        now = time.time() if now is None else now
        job_id = new_job_id(now)
        payload = body.model_dump_json()
        body_hash = hashlib.sha256(payload.encode()).hexdigest()
        fields = {
            "id": job_id, "owner": owner, "name": body.name or job_id, "state": JobState.QUEUED.value,
            "priority": body.priority, "tags": json.dumps(body.tags), "demand": demand_of(body).model_dump_json(),
            "created_at": repr(now), "updated_at": repr(now), "attempts": 0,
        }
        if isinstance(body, SweepSubmit):
            fields.update(kind="sweep", spec=body.base.model_dump_json(), sweep=payload)
        else:
            fields.update(kind="experiment", spec=body.spec.model_dump_json())
        idem = keys.idempotency(owner, idempotency_key) if idempotency_key else ""
        args: list[Any] = [job_id, repr(now), f"{job_id}|{body_hash}", IDEMPOTENCY_TTL_S]
        for k, v in fields.items():
            args += [k, v]
        created, value = self._submit(
            keys=[keys.job(job_id), keys.jobs(), keys.user_jobs(owner), keys.queue(), keys.events(job_id),
                  keys.wake(), idem],
            args=args)
        if int(created):
            return job_id, True, int(value), now
        prior_id, _, prior_hash = str(value).partition("|")
        if prior_hash != body_hash:
            raise IdempotencyConflict(
                f"Idempotency-Key {idempotency_key!r} was used for job {prior_id} with a different body: "
                "use a new key for a new experiment", field="Idempotency-Key")
        return prior_id, False, 0, now

    def raw(self, job_id: str) -> dict[str, str]:
        data = self.r.hgetall(keys.job(job_id))
        if not data:
            raise JobNotFound(f"no experiment {job_id!r}: `tlab ls` lists yours", field="id")
        return data

    def view(self, job_id: str, data: dict[str, str] | None = None, *, with_progress: bool = True) -> JobView:
        data = data if data is not None else self.raw(job_id)
        state = JobState(data["state"])
        position = reason = None
        if state == JobState.QUEUED:
            entry = self.r.hget(keys.queue_view(), job_id)
            if entry:
                q = json.loads(entry)
                position, reason = q.get("position"), q.get("reason")
            else:
                reason = "waiting for the scheduler's next decision"
        return JobView(
            id=data["id"], kind=data.get("kind", "experiment"), name=data.get("name", data["id"]),
            owner=data["owner"], state=state,
            priority=int(data.get("priority", 0)), tags=json.loads(data.get("tags", "[]")),
            spec=json.loads(data["spec"]), demand=Demand.model_validate_json(data["demand"]),
            created_at=float(data["created_at"]), started_at=_opt_float(data.get("started_at")),
            finished_at=_opt_float(data.get("finished_at")), queue_position=position, pending_reason=reason,
            attempts=int(data.get("attempts", 0)), ray_job_id=data.get("ray_job_id") or None,
            progress=self.progress(job_id, data) if with_progress else Progress(),
            summary=json.loads(data["summary"]) if data.get("summary") else None,
            failure_reason=data.get("failure_reason") or None,
        )

    def progress(self, job_id: str, data: dict[str, str]) -> Progress:
        """The latest metric event (a short look back from the end of the stream)."""
        epochs = json.loads(data["spec"]).get("training", {}).get("epochs")
        for _eid, fields in self.r.xrevrange(keys.events(job_id), count=50):
            if fields.get("kind") == "metric":
                m = json.loads(fields["data"])
                return Progress(epoch=int(m["epoch"]) + 1, epochs=epochs, train_loss=m.get("train_loss"),
                                test_loss=m.get("test_loss"))
        return Progress(epoch=0 if data["state"] != JobState.QUEUED else None, epochs=epochs)

    def list_ids(self, owner: str | None, cursor: str | None, limit: int) -> tuple[list[str], bool]:
        """Up to ``limit`` job ids newest first, after ``cursor``; and whether more follow."""
        key = keys.user_jobs(owner) if owner else keys.jobs()
        top = f"({cursor}" if cursor else "+"
        ids = self.r.zrevrangebylex(key, top, "-", start=0, num=limit + 1)
        return ids[:limit], len(ids) > limit

    def raws(self, ids: Iterable[str]) -> list[dict[str, str]]:
        pipe = self.r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(keys.job(job_id))
        return [d for d in pipe.execute() if d]

    def transition(self, job_id: str, to: JobState, *, expect: Iterable[JobState] = (), reason: str = "",
                   now: float | None = None, **fields: Any) -> bool:
        """Move a job along the transition table (atomically); False if its state did not allow it."""
        now = time.time() if now is None else now
        args: list[Any] = [to.value, repr(now), ",".join(s.value for s in expect), reason]
        for k, v in fields.items():
            args += [k, v if isinstance(v, str) else json.dumps(v)]
        ok, _cur = self._transition(keys=[keys.job(job_id), keys.queue(), keys.active(), keys.events(job_id)],
                                    args=args)
        return bool(int(ok))

    def cancel(self, job_id: str) -> JobState:
        """Queued -> cancelled at once; starting/running -> cancel requested (the scheduler stops it)."""
        for _ in range(5):
            state = JobState(self.raw(job_id)["state"])
            if state in TERMINAL:
                raise InvalidState(f"experiment {job_id} already ended ({state.value}); nothing to cancel")
            if state == JobState.QUEUED:
                if self.transition(job_id, JobState.CANCELLED, expect=[JobState.QUEUED], reason="cancelled by user"):
                    self.r.hdel(keys.queue_view(), job_id)
                    return JobState.CANCELLED
                continue  # the scheduler picked it meanwhile: ask again
            if state in ACTIVE:
                self.r.hset(keys.job(job_id), "cancel_requested", repr(time.time()))
                self.r.lpush(keys.wake(), job_id)
                return state
        raise InvalidState(f"experiment {job_id} changed state while cancelling; try again")

    def events(self, job_id: str, after: str = "-", count: int | None = None) -> list[tuple[str, dict[str, str]]]:
        start = f"({after}" if after not in ("-", "", "0") else "-"
        return self.r.xrange(keys.events(job_id), min=start, max="+", count=count)

    # ---- users -------------------------------------------------------------------------------
    def create_user(self, body: UserCreate, token: str | None = None) -> tuple[UserPublic, str]:
        user = UserPublic(name=body.name, role=body.role, quotas=body.quotas, created_at=time.time())
        token = token or f"tl_{secrets.token_urlsafe(32)}"
        if not self.r.hsetnx(keys.users(), user.name, user.model_dump_json()):
            raise UserExists(f"user {body.name!r} exists: pick another name", field="name")
        self.r.set(keys.token(hash_token(token)), user.name)
        return user, token

    def ensure_admin(self, name: str, token: str) -> UserPublic:
        """Create the admin (or re-point its token) idempotently: ``tlab up`` calls it on every start."""
        existing = self.r.hget(keys.users(), name)
        if existing:
            self.r.set(keys.token(hash_token(token)), name)
            return UserPublic.model_validate_json(existing)
        user, _ = self.create_user(UserCreate(name=name, role=Role.ADMIN, quotas=Quotas(max_gpus=1e6,
                                                                                       max_running_jobs=1000)),
                                   token)
        return user

    def user(self, name: str) -> UserPublic | None:
        raw = self.r.hget(keys.users(), name)
        return UserPublic.model_validate_json(raw) if raw else None

    def users(self) -> list[UserPublic]:
        return sorted((UserPublic.model_validate_json(v) for v in self.r.hvals(keys.users())), key=lambda u: u.name)

    def authenticate(self, token: str) -> UserPublic:
        name = self.r.get(keys.token(hash_token(token))) if token else None
        user = self.user(name) if name else None
        if user is None:
            raise Unauthorized("unknown or missing bearer token: send `Authorization: Bearer <token>` "
                               "(tlab up writes the admin's to $TLAB_HOME/admin.token)")
        return user

    # ---- fair share --------------------------------------------------------------------------
    def usage(self, now: float, half_life_s: float) -> dict[str, float]:
        """Each user's usage, decayed to ``now`` (halves every ``half_life_s``)."""
        out = {}
        for user, raw in self.r.hgetall(keys.usage()).items():
            u = json.loads(raw)
            out[user] = u["value"] * 0.5 ** (max(0.0, now - u["at"]) / half_life_s)
        return out

    def charge(self, amounts: dict[str, float], now: float, half_life_s: float) -> None:
        """Add usage (gang weight x seconds) to users, decaying what they had first."""
        if not amounts:
            return
        current = self.usage(now, half_life_s)
        self.r.hset(keys.usage(), mapping={
            user: json.dumps({"value": current.get(user, 0.0) + amount, "at": now})
            for user, amount in amounts.items()})
