"""What a job's own processes read and write of its record in Redis.

Started by the scheduler, a job reaches Redis as its own ACL user, allowed its own keys (``keys.own_keys``) but not
the job hash ``tlab:job:<id>`` (owner, state, priority, demand, its Ray submission id: what the scheduler and the API
trust; service/launch/job_acl.py). So it reads its inputs (spec, sweep, start_from, attempts) from ``keys.job_run``, the
scheduler's copy written before each submit, and writes its summary there (the scheduler copies it into the job
hash once the Ray job has ended). Run without the scheduler (tests, tools, ``TLAB_JOB_REDIS_ACL=off``) there is no
copy: the job hash itself.

Its hashes are written through the bounded script the scheduler loaded (``write_hash``: ``hset_own`` with the caps the
copy names), which refuses an entry over its cap or a write past the job's share of Redis (``ShareFull``), and, when
this process pinned its attempt (``workers.job.fence``), a write of an attempt the record has moved past
(``AttemptEnded``).
"""

from __future__ import annotations

from typing import Any

import redis

from api_schemas import keys
from api_schemas.redis_scripts import OVER_CAP, hset_job, hset_own, parse_caps
from workers.job.fence import connect, ended_error, pinned, record_keys

MARK = keys.JOB_RUN_MARK  # the copy's field naming its job: there once the scheduler wrote the copy


def job_field(client: Any, job_id: str, field: str) -> Any:
    """A field of the job's record as the scheduler gave it to the job (None if it has none)."""
    value, mark = client.hmget(keys.job_run(job_id), [field, MARK])
    return value if mark is not None else client.hget(keys.job(job_id), field)


def write_summary(client: Any, job_id: str, summary: str) -> None:
    """The job's summary (JSON), where the scheduler takes it from (or the job hash, run without one)."""
    write_field(client, job_id, "summary", summary)


def write_field(client: Any, job_id: str, field: str, value: str) -> None:
    """A field the job writes of its record: in the scheduler's copy (or the job hash, run without one)."""
    run, attempt = keys.job_run(job_id), pinned(job_id)
    if client.hget(run, MARK) is not None:
        write_hash(client, job_id, run, {field: value})
    elif attempt is None:
        client.hset(keys.job(job_id), field, value)
    else:  # (no run copy: the service's own Redis URL, which may run any script)
        script = client.register_script(hset_job(attempt))
        bounded(lambda: script(keys=[*keys.own_keys(job_id), keys.job(job_id)], args=[field, value]))


class ShareFull(RuntimeError):
    """A bounded write refused: an entry over its cap, or the job's keys at its share of Redis (TLAB_JOB_REDIS_MB)."""


def write_caps(client: Any, job_id: str) -> tuple[int, int]:
    """(bytes per entry, bytes of the job's keys) its bounded writes are held to: the caps the scheduler named in
    its copy (``keys.JOB_RUN_CAPS``), the default's run without one."""
    return parse_caps(job_field(client, job_id, keys.JOB_RUN_CAPS))


def bounded(call: Any) -> Any:
    """``call()``, a refused bounded write raised as ``ShareFull`` with Redis's words (an ended attempt's as
    ``AttemptEnded``)."""
    try:
        return call()
    except redis.ResponseError as err:
        ended = ended_error(err)
        if ended is not None:
            raise ended from None
        text = str(err)
        if OVER_CAP in text:
            raise ShareFull(text[text.index(OVER_CAP) + len(OVER_CAP):].strip()) from None
        raise


def write_hash(client: Any, job_id: str, key: str, mapping: dict[str, str],
               caps: tuple[int, int] | None = None) -> None:
    """``HSET key mapping`` through the bounded script (``key``: one of the job's own keys), fenced to the attempt
    this process pinned."""
    attempt = pinned(job_id)
    script = client.register_script(hset_own(caps or write_caps(client, job_id), attempt))
    own = keys.own_keys(job_id) if attempt is None else record_keys(client, job_id)
    bounded(lambda: script(keys=own, args=[own.index(key) + 1, *(x for kv in mapping.items() for x in kv)]))


def attempt_of(url: str, job_id: str) -> int:
    """The scheduler's attempt number of the job (the ``attempts`` it sets at each start; 1 if none)."""
    client = connect(url, decode_responses=True)
    try:
        return int(job_field(client, job_id, "attempts") or 1)
    finally:
        client.close()
