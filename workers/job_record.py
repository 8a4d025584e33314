"""What a job's own processes read and write of its record in Redis.

Started by the scheduler, a job reaches Redis as its own ACL user, allowed ``tlab:job:<id>:*`` but not the job
hash ``tlab:job:<id>`` (owner, state, priority, demand, its Ray submission id: what the scheduler and the API
trust; service/job_acl.py). So it reads its inputs (spec, sweep, start_from, attempts) from ``keys.job_run``, the
scheduler's copy written before each submit, and writes its summary there (the scheduler copies it into the job
hash once the Ray job has ended). Run without the scheduler (tests, tools, ``TLAB_JOB_REDIS_ACL=off``) there is no
copy: the job hash itself.
"""

from __future__ import annotations

from typing import Any

from api_schemas import keys

MARK = keys.JOB_RUN_MARK  # the copy's field naming its job: there once the scheduler wrote the copy


def job_field(client: Any, job_id: str, field: str) -> Any:
    """A field of the job's record as the scheduler gave it to the job (None if it has none)."""
    value, mark = client.hmget(keys.job_run(job_id), [field, MARK])
    return value if mark is not None else client.hget(keys.job(job_id), field)


def write_summary(client: Any, job_id: str, summary: str) -> None:
    """The job's summary (JSON), where the scheduler takes it from (or the job hash, run without one)."""
    run = keys.job_run(job_id)
    client.hset(run if client.hget(run, MARK) is not None else keys.job(job_id), "summary", summary)
