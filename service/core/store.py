"""The Redis store: jobs, users and tokens, usage, idempotency. Every state change is one Lua call."""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis
from pydantic import ValidationError

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
    UserUpdate,
)
from api_schemas.lineage import lineage_view
from api_schemas.preflight import preflight_of
from api_schemas.redis_scripts import SUBMIT, TRANSITION
from api_schemas.sweeps import SweepSubmit
from service.core.errors import (
    IdempotencyConflict,
    InvalidInput,
    InvalidState,
    JobNotFound,
    TooManyRequests,
    Unauthorized,
    UserExists,
    UserNotFound,
)

IDEMPOTENCY_TTL_S = 24 * 3600
QUEUED_RETRY_S = 30  # Retry-After when the user's queue is full: about when a short job has moved on
WAKE_CHUNK_S = 2.0  # the longest single BLPOP (Store.wait_wake): under redis-py's 5 s socket timeout


def new_job_id(now: float) -> str:
    """Sortable by creation time (hex milliseconds) with 24 random bits: ``18f3a2b4c5d-9e1f2a``."""
    return f"{int(now * 1000):011x}-{secrets.token_hex(3)}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def redact_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (for logs and the console)."""
    head, at, tail = url.rpartition("@")
    scheme, sep, _ = head.partition("://")
    return f"{scheme}{sep}:***@{tail}" if at else url


def new_token() -> str:
    return f"tl_{secrets.token_urlsafe(32)}"


def _point_token(pipe: redis.client.Pipeline, name: str, token: str, old_hash: str | None) -> None:
    """Queue: ``token`` signs in as ``name`` and is its only valid token (the old one's key goes)."""
    digest = hash_token(token)
    if old_hash and old_hash != digest:
        pipe.delete(keys.token(old_hash))
    pipe.set(keys.token(digest), name)
    pipe.set(keys.user_token(name), digest)


def merged_quotas(quotas: Quotas, change: dict[str, Any]) -> Quotas:
    """``quotas`` with the fields in ``change`` replaced, validated whole and strictly, as JSON Schema types them
    (``"5"`` is no number, ``true`` no integer, ``5.0`` is one): an error names ``quotas.FIELD``."""
    change = {k: int(v) if isinstance(v, float) and math.isfinite(v) and v.is_integer() else v
              for k, v in change.items()}
    try:
        return Quotas.model_validate({**quotas.model_dump(), **change}, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in ("quotas", *first["loc"]))
        raise InvalidInput(first["msg"], field=field) from None


def demand_of(submit: ExperimentSubmit | SweepSubmit) -> Demand:
    """An experiment's gang is its workers; a sweep's is its workers times the trials run at once, each trial at the
    most its ``resources.*`` axes may draw (``SweepSubmit.widest_resources``)."""
    if isinstance(submit, SweepSubmit):
        r, concurrent = submit.widest_resources(), submit.max_concurrent_trials
    else:
        r, concurrent = submit.spec.resources, 1
    return Demand(workers=r.workers * concurrent, cpus_per_worker=r.cpus_per_worker,
                  gpus_per_worker=r.gpus_per_worker, gpu_type=r.gpu_type, memory_gb=r.memory_gb)


def _job_fields(job_id: str, owner: str, body: ExperimentSubmit | SweepSubmit, payload: str, now: float,
                extra: dict[str, str] | None = None) -> dict[str, Any]:
    """A new job's hash: ``payload`` is the body's JSON (a sweep keeps it whole, an experiment its spec);
    ``extra``: more fields (a continued or forked job's lineage)."""
    fields: dict[str, Any] = {**(extra or {}),
        "id": job_id, "owner": owner, "name": body.name or job_id, "state": JobState.QUEUED.value,
        "priority": body.priority, "tags": json.dumps(body.tags), "demand": demand_of(body).model_dump_json(),
        "created_at": repr(now), "updated_at": repr(now), "attempts": 0,
    }
    if body.after:
        fields["after"] = json.dumps(list(dict.fromkeys(body.after)))
    if body.notify:
        fields.update(notify=body.notify.model_dump_json(), notify_on=",".join(body.notify.on))
    if isinstance(body, SweepSubmit):
        fields.update(kind="sweep", spec=body.base.model_dump_json(), sweep=payload)
    else:
        fields.update(kind="experiment", spec=body.spec.model_dump_json())
    return fields


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
               now: float | None = None, queued_cap: int | None = None,
               extra: dict[str, str] | None = None) -> tuple[str, bool, int, float]:
        """Queue a job: (id, created, queue length, created_at). A repeated Idempotency-Key with the same
        body returns the original id with created=False; with another body it raises IdempotencyConflict.
        With ``queued_cap``, TooManyRequests (429) if ``owner`` has that many jobs queued: counted and queued in
        one Lua call, so concurrent submits cannot pass it."""
        now = time.time() if now is None else now
        job_id = new_job_id(now)
        payload = body.model_dump_json()
        body_hash = hashlib.sha256(payload.encode()).hexdigest()
        idem = keys.idempotency(owner, idempotency_key) if idempotency_key else ""
        args: list[Any] = [job_id, repr(now), f"{job_id}|{body_hash}", IDEMPOTENCY_TTL_S,
                           -1 if queued_cap is None else queued_cap, keys.job("")]
        for k, v in _job_fields(job_id, owner, body, payload, now, extra).items():
            args += [k, v]
        status, value = self._submit(
            keys=[keys.job(job_id), keys.jobs(), keys.user_jobs(owner), keys.queue(), keys.events(job_id),
                  keys.wake(), idem, keys.user_queued(owner)],
            args=args)
        if int(status) == 1:
            return job_id, True, int(value), now
        if int(status) == 2:
            raise TooManyRequests(f"you have {value} jobs queued, your max_queued_jobs quota: wait for some to start "
                                  "or cancel some", field="max_queued_jobs", retry_after_s=QUEUED_RETRY_S)
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
            preemptions=int(data.get("preemptions") or 0), last_preemption=data.get("last_preemption") or None,
            progress=self.progress(job_id, data) if with_progress else Progress(),
            summary=json.loads(data["summary"]) if data.get("summary") else None,
            failure_reason=data.get("failure_reason") or None, after=json.loads(data.get("after") or "[]"),
            notify=json.loads(data["notify"]) if data.get("notify") else None, **lineage_view(data),
            preflight=preflight_of(data),
        )

    def last_metric(self, job_id: str) -> dict[str, Any] | None:
        """The job's latest epoch record (a short look back from the end of its stream); None before its first."""
        for _eid, fields in self.r.xrevrange(keys.events(job_id), count=50):
            if fields.get("kind") == "metric":
                try:  # the job's own process wrote it: a malformed one is skipped, never the whole view
                    m = json.loads(fields.get("data") or "")
                    if isinstance(m, dict) and isinstance(m.get("epoch"), int):
                        return m
                except ValueError:
                    continue
        return None

    def progress(self, job_id: str, data: dict[str, str]) -> Progress:
        """Where the job is: its latest epoch record's numbers."""
        epochs = json.loads(data["spec"]).get("training", {}).get("epochs")
        m = self.last_metric(job_id)
        if m is not None:
            try:
                return Progress(epoch=m["epoch"] + 1, epochs=epochs, train_loss=m.get("train_loss"),
                                test_loss=m.get("test_loss"), gpu_memory_mb=m.get("gpu_memory_mb"),
                                gpu_memory_mb_ranks=m.get("gpu_memory_mb_ranks"))
            except ValueError:  # (pydantic's ValidationError) numbers that are not numbers: the epoch alone
                return Progress(epoch=m["epoch"] + 1, epochs=epochs)
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
        ok, cur = self._transition(keys=[keys.job(job_id), keys.queue(), keys.active(), keys.events(job_id),
                                         keys.notify_outbox(), keys.job_run(job_id)], args=args)
        if int(ok) and cur == JobState.QUEUED.value and to in TERMINAL and int(self.r.hget(keys.job(job_id),
                                                                                         "attempts") or 0):
            self.r.sadd(keys.unsettled(), job_id)  # it ran before it was requeued: files to prune and count
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

    def wait_wake(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a push on the scheduler's wake list (a submit, a cancel); True if one came.
        BLPOP in chunks of at most ``WAKE_CHUNK_S``: redis-py 8 gives every read a 5 s socket timeout, so a longer
        BLPOP (a ``TLAB_TICK_S`` of 5 or more) raised TimeoutError instead of returning empty."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) >= 0.01:  # Redis reads a timeout under 1 ms as 0: forever
            if self.r.blpop([keys.wake()], timeout=round(min(left, WAKE_CHUNK_S), 3)):
                return True
        return False

    def log_event(self, job_id: str, level: str, message: str, now: float | None = None) -> None:
        """A ``log`` event the service itself adds to the job's stream (a preemption, a webhook that failed)."""
        data = {"kind": "log", "level": level, "message": message, "at": time.time() if now is None else now}
        self.r.xadd(keys.events(job_id), {"kind": "log", "data": json.dumps(data)}, maxlen=keys.STREAM_MAXLEN,
                    approximate=True)

    def events(self, job_id: str, after: str = "-", count: int | None = None) -> list[tuple[str, dict[str, str]]]:
        start = f"({after}" if after not in ("-", "", "0") else "-"
        return self.r.xrange(keys.events(job_id), min=start, max="+", count=count)

    # ---- users -------------------------------------------------------------------------------
    def create_user(self, body: UserCreate, token: str | None = None) -> tuple[UserPublic, str]:
        user = UserPublic(name=body.name, role=body.role, quotas=body.quotas, created_at=time.time(),
                          can_submit_code=body.can_submit_code)
        token = token or new_token()
        if not self.r.hsetnx(keys.users(), user.name, user.model_dump_json()):
            raise UserExists(f"user {body.name!r} exists: pick another name", field="name")
        pipe = self.r.pipeline()
        _point_token(pipe, user.name, token, None)
        pipe.execute()
        return user, token

    def ensure_admin(self, name: str, token: str) -> UserPublic:
        """Create the admin, or point its token at ``token`` (the previous one stops working); ``tlab up`` calls it
        on every start, so the same token again changes nothing."""
        if self.r.hexists(keys.users(), name):
            return self.rotate_token(name, token)[0]
        user, _ = self.create_user(UserCreate(name=name, role=Role.ADMIN, can_submit_code=True,
                                              quotas=Quotas(max_gpus=1e6, max_cpus=1e6, max_running_jobs=1000)), token)
        return user

    def rotate_token(self, name: str, token: str | None = None) -> tuple[UserPublic, str]:
        """A new token for ``name``; the old one is refused from this moment, in every API process."""
        token = token or new_token()
        same = self.r.get(keys.user_token(name)) == hash_token(token)
        user = self._change_user(name, lambda u: u if same else u.model_copy(update={"token_rotated_at": time.time()}),
                                 token=token)
        return user, token

    def update_user(self, name: str, change: UserUpdate) -> UserPublic:
        """Apply a PATCH: quotas merge field by field (re-validated whole), flags replace."""
        def apply(user: UserPublic) -> UserPublic:
            update: dict[str, Any] = {k: v for k, v in (("can_submit_code", change.can_submit_code),
                                                        ("disabled", change.disabled)) if v is not None}
            if change.quotas is not None:
                update["quotas"] = merged_quotas(user.quotas, change.quotas)
            return user.model_copy(update=update)

        return self._change_user(name, apply)

    def _change_user(self, name: str, apply: Callable[[UserPublic], UserPublic],
                     token: str | None = None) -> UserPublic:
        """Read, change and write a user atomically (WATCH on the users hash), optionally pointing its token at
        ``token``; the auth generation moves so every API process re-checks its cached logins."""
        def run(pipe: redis.client.Pipeline) -> UserPublic:
            raw = pipe.hget(keys.users(), name)
            if not raw:
                raise UserNotFound(f"no user {name!r}: `tlab users list` shows them", field="name")
            user = apply(UserPublic.model_validate_json(raw))
            old = pipe.get(keys.user_token(name))
            pipe.multi()
            pipe.hset(keys.users(), name, user.model_dump_json())
            if token is not None:
                _point_token(pipe, name, token, old)
            pipe.incr(keys.auth_generation())
            return user

        return self.r.transaction(run, keys.users(), keys.user_token(name), value_from_callable=True)

    def user(self, name: str) -> UserPublic | None:
        raw = self.r.hget(keys.users(), name)
        return UserPublic.model_validate_json(raw) if raw else None

    def users(self) -> list[UserPublic]:
        return sorted((UserPublic.model_validate_json(v) for v in self.r.hvals(keys.users())), key=lambda u: u.name)

    def webhook_secret(self, name: str) -> str:
        """The user's webhook signing secret, made on first use (SET NX: two first uses agree)."""
        self.r.set(keys.webhook_secret(name), secrets.token_hex(32), nx=True)
        return str(self.r.get(keys.webhook_secret(name)))

    def auth_generation(self) -> int:
        return int(self.r.get(keys.auth_generation()) or 0)

    def authenticate(self, token: str) -> UserPublic:
        """The token's user; 401 for an unknown or rotated token and for a disabled user."""
        digest = hash_token(token)
        name = self.r.get(keys.token(digest)) if token else None
        raw = current = None
        if name:
            raw, current = self.r.pipeline(transaction=False).hget(keys.users(), name).get(
                keys.user_token(name)).execute()
        if not raw or (current is not None and current != digest):  # no current hash: made before rotation existed
            raise Unauthorized("unknown, rotated or missing bearer token: send `Authorization: Bearer <token>` "
                               "(tlab up writes the admin's to $TLAB_HOME/admin.token)")
        user = UserPublic.model_validate_json(raw)
        if user.disabled:
            raise Unauthorized(f"user {user.name!r} is disabled: an admin re-enables it with "
                               f"`tlab users enable {user.name}`")
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
