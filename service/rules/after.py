"""Dependencies between jobs (``after: [id, ...]``): checked at submit, settled by the scheduler each tick.

A job with ``after`` stays queued, with ``waiting for <id> (<state>)`` as its reason, until every job it names has
``succeeded``; if one ends ``failed`` or ``cancelled``, it ends ``failed`` itself with a reason naming that job.
All of it is read from Redis each tick (the job hashes' ``after`` and ``state``), so a restarted scheduler
carries on where the last one stopped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from api_schemas import keys
from api_schemas.jobs import TERMINAL, JobState, Role, UserPublic
from service.core.errors import InvalidInput
from service.core.store import Store
from service.rules.policy import QueuedJob

MAX_WALK = 1000  # jobs a cycle check may read (unfinished jobs reachable through `after`)
BROKEN = (JobState.FAILED.value, JobState.CANCELLED.value)
SHOWN = 3  # dependencies named in a waiting reason (the rest counted)


def check_after(store: Store, user: UserPublic, after: list[str], field: str = "after") -> None:
    """InvalidInput (422) naming ``field`` unless every id is a job the user may wait for that can still succeed,
    and no cycle runs through them."""
    ids = list(dict.fromkeys(after))
    if not ids:
        return
    pipe = store.r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(keys.job(job_id), ["owner", "state"])
    for job_id, (owner, state) in zip(ids, pipe.execute(), strict=True):
        if owner is None:
            raise InvalidInput(f"no job {job_id}: `tlab ls` lists yours", field=field)
        if user.role != Role.ADMIN and owner != user.name:
            raise InvalidInput(f"job {job_id} is another user's: you can wait only for your own jobs", field=field)
        if state in BROKEN:
            raise InvalidInput(f"job {job_id} already ended {state} and can never succeed: leave it out",
                               field=field)
    cycle = find_cycle(store, ids)
    if cycle:
        raise InvalidInput(f"a dependency cycle: {' -> '.join(cycle)}: no job in it could ever start", field=field)


def _unfinished_deps(store: Store, job_id: str) -> list[str]:
    """What ``job_id`` waits for; a finished job waits for nothing (its dependencies are settled)."""
    state, after = store.r.hmget(keys.job(job_id), ["state", "after"])
    return [] if state is None or JobState(state) in TERMINAL else json.loads(after or "[]")


def find_cycle(store: Store, roots: list[str]) -> list[str] | None:
    """A cycle reachable from ``roots`` through unfinished jobs' ``after`` (``[a, b, a]``), else None (depth
    first, iterative; at most MAX_WALK jobs read)."""
    edges: dict[str, list[str]] = {}

    def deps(job_id: str) -> Iterator[str]:
        if len(edges) >= MAX_WALK:
            raise InvalidInput(f"more than {MAX_WALK} unfinished jobs are chained through after: wait for some "
                               "to finish", field="after")
        edges[job_id] = _unfinished_deps(store, job_id)
        return iter(edges[job_id])

    done: set[str] = set()
    for root in roots:
        if root in done:
            continue
        path, stack = [root], [deps(root)]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                done.add(path.pop())
                stack.pop()
            elif nxt in path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                stack.append(deps(nxt))
    return None


def waiting_reason(after: tuple[str, ...], states: dict[str, str | None]) -> str | None:
    """``waiting for <id> (<state>), ...`` for the dependencies not yet succeeded (None: all have)."""
    pending = [d for d in after if states.get(d) != JobState.SUCCEEDED.value]
    if not pending:
        return None
    shown = ", ".join(f"{d} ({states.get(d) or 'missing'})" for d in pending[:SHOWN])
    more = f" and {len(pending) - SHOWN} more" if len(pending) > SHOWN else ""
    return f"waiting for {shown}{more}"


def settle(store: Store, queued: list[QueuedJob], now: float) -> tuple[dict[str, str], set[str]]:
    """For the queued jobs with dependencies: ({job id: why it waits}, {ids just failed because a dependency
    ended failed or cancelled, or is missing})."""
    waiting = [job for job in queued if job.after]
    if not waiting:
        return {}, set()
    dep_ids = sorted({d for job in waiting for d in job.after})
    pipe = store.r.pipeline(transaction=False)
    for d in dep_ids:
        pipe.hget(keys.job(d), "state")
    states: dict[str, str | None] = dict(zip(dep_ids, pipe.execute(), strict=True))
    blocked: dict[str, str] = {}
    failed: set[str] = set()
    for job in waiting:
        broken = next((d for d in job.after if states[d] is None or states[d] in BROKEN), None)
        if broken is None:
            if (why := waiting_reason(job.after, states)) is not None:
                blocked[job.id] = why
            continue
        reason = (f"dependency {broken} ended {states[broken] or 'missing'}; this job needed it to succeed "
                  f"(after={broken})")
        store.transition(job.id, JobState.FAILED, expect=[JobState.QUEUED], reason=reason, failure_reason=reason,
                         now=now)
        failed.add(job.id)  # failed now, or cancelled meanwhile: out of this decision either way
    return blocked, failed
