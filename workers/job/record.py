"""What a job's own processes read and write of its record in Redis.

Started by the scheduler, a job reaches Redis as its own ACL user, allowed ``tlab:job:<id>:*`` but not the job
hash ``tlab:job:<id>`` (owner, state, priority, demand, its Ray submission id: what the scheduler and the API
trust; service/launch/job_acl.py). So it reads its inputs (spec, sweep, start_from, attempts) from ``keys.job_run``, the
scheduler's copy written before each submit, and writes its summary there (the scheduler copies it into the job
hash once the Ray job has ended). Run without the scheduler (tests, tools, ``TLAB_JOB_REDIS_ACL=off``) there is no
copy: the job hash itself.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from api_schemas import keys

MARK = keys.JOB_RUN_MARK  # the copy's field naming its job: there once the scheduler wrote the copy


def connect(url: str, **kw: Any) -> redis.Redis:
    """A client that rides out a Redis restart: Redis is back in about a second, but a restarted Redis has lost the
    job's ACL user until the scheduler's next tick makes it again, so a job's writer tries 15 times, waiting a random
    part of 0.1 s doubling to 1 s (up to 12.5 s in all; redis-py's default 10 tries wait up to 5.3 s)."""
    return redis.Redis.from_url(url, retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.1), 15), **kw)


def job_field(client: Any, job_id: str, field: str) -> Any:
    """A field of the job's record as the scheduler gave it to the job (None if it has none)."""
    value, mark = client.hmget(keys.job_run(job_id), [field, MARK])
    return value if mark is not None else client.hget(keys.job(job_id), field)


def write_summary(client: Any, job_id: str, summary: str) -> None:
    """The job's summary (JSON), where the scheduler takes it from (or the job hash, run without one)."""
    write_field(client, job_id, "summary", summary)


def write_field(client: Any, job_id: str, field: str, value: str) -> None:
    """A field the job writes of its record: in the scheduler's copy (or the job hash, run without one)."""
    run = keys.job_run(job_id)
    client.hset(run if client.hget(run, MARK) is not None else keys.job(job_id), field, value)


def attempt_of(url: str, job_id: str) -> int:
    """The scheduler's attempt number of the job (the ``attempts`` it sets at each start; 1 if none)."""
    client = connect(url, decode_responses=True)
    try:
        return int(job_field(client, job_id, "attempts") or 1)
    finally:
        client.close()
