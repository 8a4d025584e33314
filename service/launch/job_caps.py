"""A job's share of Redis (``TLAB_JOB_REDIS_MB``): what its own keys hold, checked at each scheduler tick.

A job's user may touch its own keys only (``keys.own_keys``, by their exact names: ``service.launch.job_acl``), and
the workers write them through the bounded scripts of ``api_schemas.redis_scripts``, which refuse a write that would
take those keys over the share. That is the first line. Redis checks a script's calls against the user that runs it,
so the user also holds the raw ``XADD``/``HSET`` the scripts call, and a job's own code can write raw into its own
keys past the share: this is the second line. Each tick the scheduler asks Redis what each running job's keys take
(``MEMORY USAGE``: its stream whole, its hashes sampled); a job over its cap loses every write right (its user keeps
its reads), its stream is trimmed to its last entries (``KEEP`` at most, half its cap) and it gets one error ``log``
event saying why, which is its failure reason when it then stops. Redis's own ``maxmemory`` with ``noeviction``
(``TLAB_REDIS_MAXMEMORY_MB``, set where ``tlab up`` starts Redis) is the hard stop between two ticks.
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


def usage(r: redis.Redis, job_ids: list[str]) -> dict[str, int]:
    """Bytes each job's own keys (every key its user may write) take in Redis, one pipeline, as the bounded scripts
    measure them: ``MEMORY USAGE`` of its stream whole (``SAMPLES 0``, a step per node: a sample is of its first
    nodes only), of each hash by a sample of 5 fields."""
    pipe = r.pipeline(transaction=False)
    counts = []
    for job_id in job_ids:
        own = keys.own_keys(job_id)
        counts.append(len(own))
        for key in own:
            pipe.memory_usage(key, samples=0 if key == keys.events(job_id) else 5)
    sizes, out, at = pipe.execute(), {}, 0
    for job_id, n in zip(job_ids, counts, strict=True):
        out[job_id], at = sum(int(s or 0) for s in sizes[at:at + n]), at + n
    return out


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
