"""A job's share of Redis (``TLAB_JOB_REDIS_MB``): what its own keys hold, checked at each scheduler tick.

A job writes its keys as its ACL user (``service.launch.job_acl``) with raw ``XADD``/``HSET`` as well as through the
sink's script, so no write path of its own can be trusted to stay small. Each tick the scheduler asks Redis what
each running job's keys take (``MEMORY USAGE``, sampled); a job over its cap loses every write right (its user
keeps its reads), its stream is trimmed to its last entries (``KEEP`` at most, half its cap) and it gets one
error ``log`` event saying why, which is its failure reason when it then stops. Redis's own ``maxmemory`` with
``noeviction`` (``TLAB_REDIS_MAXMEMORY_MB``, set where ``tlab up`` starts Redis) is the hard stop between two ticks.
"""

from __future__ import annotations

import json
import logging
import time

import redis

from api_schemas import keys

log = logging.getLogger("tlab.scheduler")
KEEP = 1000  # stream entries an over-cap job keeps
WRITES = ("xadd", "hset", "hsetnx", "del", "evalsha")  # what the job's user may no longer run
JOB_KEYS = (keys.events, keys.emitted, keys.trials, keys.job_run)


def usage(r: redis.Redis, job_ids: list[str]) -> dict[str, int]:
    """Bytes each job's keys take in Redis (sampled: ``MEMORY USAGE key SAMPLES 5``), one pipeline."""
    pipe = r.pipeline(transaction=False)
    for job_id in job_ids:
        for key in JOB_KEYS:
            pipe.memory_usage(key(job_id), samples=5)
    sizes = pipe.execute()
    return {job_id: sum(int(s or 0) for s in sizes[i * len(JOB_KEYS):(i + 1) * len(JOB_KEYS)])
            for i, job_id in enumerate(job_ids)}


def clamp(r: redis.Redis, job_id: str, user: str, used: int, cap: int) -> None:
    """Take the job's write rights, trim its stream and say why in it (the service's own write)."""
    r.execute_command("ACL", "SETUSER", user, *(f"-{c}" for c in WRITES))
    kept = trim(r, keys.events(job_id), cap // 2)
    message = (f"this job wrote {used / 2**20:.1f} MiB into Redis, over its cap of {cap / 2**20:g} MiB "
               f"(TLAB_JOB_REDIS_MB): its writes are refused and its events trimmed to the last {kept}; "
               "write fewer or smaller events")
    r.xadd(keys.events(job_id), {"kind": "log", "data": json.dumps(
        {"kind": "log", "level": "error", "message": message, "time": time.time()})})
    log.warning("job %s: %s", job_id, message)


def trim(r: redis.Redis, key: str, budget: int) -> int:
    """Trim the stream to its last ``KEEP`` entries, then halve that until it takes at most ``budget`` bytes."""
    kept = KEEP
    r.xtrim(key, maxlen=kept, approximate=False)
    while kept > 1 and int(r.memory_usage(key, samples=0) or 0) > budget:
        kept //= 2
        r.xtrim(key, maxlen=kept, approximate=False)
    return kept


def enforce(r: redis.Redis, users: dict[str, str], cap: int, clamped: set[str]) -> None:
    """Clamp each job of ``users`` (job id -> its Redis user) over ``cap`` bytes, once (``clamped`` remembers)."""
    todo = sorted(j for j in users if j not in clamped)
    if not todo:
        return
    for job_id, used in usage(r, todo).items():
        if used > cap:
            clamp(r, job_id, users[job_id], used, cap)
            clamped.add(job_id)
