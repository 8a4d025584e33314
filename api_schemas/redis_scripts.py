"""Lua scripts, in one module: each is atomic on the Redis server and safe to repeat."""

import hashlib
from collections.abc import Mapping

from api_schemas.keys import STREAM_MAXLEN

OUTBOX_MAXLEN = 10_000  # webhook entries kept in the outbox (the sender takes them within a tick)

# KEYS[1] = events stream, KEYS[2] = emitted hash; ARGV = maxlen, then (identity, kind, data) triples.
# An event whose identity is already in the hash is skipped, so a worker restarted from a
# checkpoint can re-emit the epochs it redoes without duplicating them. Identity "" = always add.
XADD_ONCE = """
local added = 0
for i = 2, #ARGV, 3 do
  local ident = ARGV[i]
  if ident == '' or redis.call('HSETNX', KEYS[2], ident, 1) == 1 then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'kind', ARGV[i + 1], 'data', ARGV[i + 2])
    added = added + 1
  end
end
return added
"""


def _lua_transition_table() -> str:
    """The Python transition table (api_schemas.jobs.TRANSITIONS) as a Lua table literal."""
    from api_schemas.jobs import TRANSITIONS

    rows = []
    for src, targets in TRANSITIONS.items():
        inner = ", ".join(f"['{t.value}'] = true" for t in sorted(targets))
        rows.append(f"['{src.value}'] = {{{inner}}}")
    return "{" + ", ".join(rows) + "}"


# The max_queued_jobs check of SUBMIT and RERUN: KEYS[8] = the user's queued zset, ARGV[1] = job id, ARGV[2] = now,
# ARGV[5] = the cap (-1 = none), ARGV[6] = the job hash key prefix. Returns {2, queued count} at the cap.
QUEUED_CAP = """local cap = tonumber(ARGV[5])
if cap >= 0 then
  local queued = 0
  for _, id in ipairs(redis.call('ZRANGE', KEYS[8], 0, -1)) do
    if redis.call('HGET', ARGV[6] .. id, 'state') == 'queued' then
      queued = queued + 1
    else
      redis.call('ZREM', KEYS[8], id)
    end
  end
  if queued >= cap then return {2, queued} end
  redis.call('ZADD', KEYS[8], ARGV[2], ARGV[1])
end
"""

# The service's own `status` (with a state and an `at`) and `end` entries: each script that writes one appends its
# stream id and the digest of its content (`entry_digest`) to the job hash's `service_events` (a key the job's Redis
# user cannot write), as `<id>=<sha1>,`; the SSE relay passes a `status` with a state and an `at`, or an `end`, only
# when its id is there with the digest of what the entry holds (service/api/event_vetting.py): a job cannot end its
# followers' streams or claim a state by writing such an entry itself, nor by rewriting its stream under the ids the
# service listed. `ours(job, stream, maxlen, kind, data)` adds the entry (MAXLEN ~ maxlen unless nil) and lists it.
SERVICE_EVENTS_FIELD = "service_events"
OURS = """local function ours(job, stream, maxlen, kind, data)
  local sid
  if maxlen then
    sid = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'kind', kind, 'data', data)
  else
    sid = redis.call('XADD', stream, '*', 'kind', kind, 'data', data)
  end
  local digest = redis.sha1hex('4:kind' .. #kind .. ':' .. kind .. '4:data' .. #data .. ':' .. data)
  redis.call('HSET', job, '__FIELD__', (redis.call('HGET', job, '__FIELD__') or '') .. sid .. '=' .. digest .. ',')
  return sid
end
""".replace("__FIELD__", SERVICE_EVENTS_FIELD)


def entry_digest(fields: Mapping[str, str | bytes]) -> str:
    """The digest ``ours`` lists of an entry: SHA-1 of its fields in order, each name and value as ``<bytes>:<it>``."""
    text = b""
    for name, value in fields.items():
        for part in (name, value):
            raw = part if isinstance(part, bytes) else str(part).encode()
            text += str(len(raw)).encode() + b":" + raw
    return hashlib.sha1(text).hexdigest()


def service_events(raw: str | bytes | None) -> dict[str, str] | None:
    """The job hash's ``service_events`` as id -> digest ('' for an id listed alone, by a service that recorded no
    digest yet); None when the field is absent."""
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    return dict(item.partition("=")[::2] for item in text.split(",") if item)


# KEYS: job hash, jobs zset, user's jobs zset, queue zset, events stream, wake list, idempotency key ('' = none),
#       the user's queued zset (the max_queued_jobs count)
# ARGV: job id, created_at, idempotency value ("id|body-sha"), idempotency ttl s, queued cap (-1 = none),
#       job hash key prefix, then hash field/value pairs.
# The cap is checked and the job queued in one step: of the user's queued zset, the ids whose job is no longer
# queued are pruned (they read keys named from ARGV[6]: one Redis, no cluster) and the rest counted.
# Returns {0, existing idempotency value} when the key was used before, {2, queued count} when the user already
# has the cap queued, else {1, queue length}.
SUBMIT = OURS + """
if KEYS[7] ~= '' then
  local prior = redis.call('GET', KEYS[7])
  if prior then return {0, prior} end
end
__QUEUED_CAP__if KEYS[7] ~= '' then redis.call('SET', KEYS[7], ARGV[3], 'EX', ARGV[4]) end
local fields = {}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
ours(KEYS[1], KEYS[5], nil, 'status', cjson.encode({kind = 'status', state = 'queued', at = tonumber(ARGV[2])}))
redis.call('LPUSH', KEYS[6], ARGV[1])
redis.call('LTRIM', KEYS[6], 0, 0)
return {1, redis.call('ZCARD', KEYS[4])}
""".replace("__QUEUED_CAP__", QUEUED_CAP)

# KEYS: job hash, queue zset, active set, events stream, notify outbox stream
# ARGV: to-state, now, comma-separated states the caller expects the job in ('' = any), reason, field/value pairs.
# Moves the job only along the transition table; keeps the queue and active sets in step; writes a
# `status` event (and `end` when the state is terminal); when the job's `notify_on` (comma-separated) names the
# new state (`preempted` for running -> queued), adds a webhook entry to the outbox in the same step.
# Returns {1, from} or {0, current state}.
TRANSITION = OURS + """
local T = __TABLE__
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {0, 'missing'} end
local to = ARGV[1]
if ARGV[3] ~= '' then
  local ok = false
  for s in string.gmatch(ARGV[3], '[^,]+') do if s == cur then ok = true end end
  if not ok then return {0, cur} end
end
if not T[cur] or not T[cur][to] then return {0, cur} end
local now = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'state', to, 'updated_at', ARGV[2])
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
local id = redis.call('HGET', KEYS[1], 'id')
if to == 'queued' then
  redis.call('ZADD', KEYS[2], tonumber(redis.call('HGET', KEYS[1], 'created_at')), id)
else
  redis.call('ZREM', KEYS[2], id)
end
if to == 'starting' or to == 'running' then redis.call('SADD', KEYS[3], id) else redis.call('SREM', KEYS[3], id) end
local event = {kind = 'status', state = to, at = now}
if ARGV[4] ~= '' then event['reason'] = ARGV[4] end
ours(KEYS[1], KEYS[4], nil, 'status', cjson.encode(event))
if T[to] and next(T[to]) == nil then
  redis.call('HSET', KEYS[1], 'finished_at', ARGV[2])
  redis.call('HDEL', KEYS[1], 'cancel_requested')
  ours(KEYS[1], KEYS[4], nil, 'end', cjson.encode({kind = 'end', state = to, at = now}))
end
local on = redis.call('HGET', KEYS[1], 'notify_on')
if on and KEYS[5] then
  local label = to
  if to == 'queued' and cur == 'running' then label = 'preempted' end
  if string.find(',' .. on .. ',', ',' .. label .. ',', 1, true) then
    redis.call('XADD', KEYS[5], 'MAXLEN', '~', __OUTBOX_MAXLEN__, '*', 'job', id, 'state', label,
               'reason', ARGV[4], 'attempt', redis.call('HGET', KEYS[1], 'attempts') or '0')
  end
end
return {1, cur}
""".replace("__TABLE__", _lua_transition_table()).replace("__OUTBOX_MAXLEN__", str(OUTBOX_MAXLEN))

# KEYS: job hash, queue zset, events stream, wake list, trials hash, the job's run hash (service/launch/job_acl.py), '',
#       the owner's queued zset (the max_queued_jobs count)
# ARGV: job id, now, comma-separated states the sweep must be in, reason, queued cap (-1 = none), job hash key prefix,
#       the number N of job hash fields to clear, those N names, then trial id / row JSON pairs.
# An ended sweep back to the queue for a rerun (service/api/sweep_rerun.py), in one step: the cap checked as at submit,
# the fields of the ended run cleared (its summary also in the run hash), the rows written, and the stream's `end`
# events among its last 1000 entries deleted (a follower reading the history then goes on into the rerun), before
# the `queued` status event. Returns {1, from}, {0, current state} or {2, queued count} (the cap).
RERUN = OURS + """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {0, 'missing'} end
local ok = false
for s in string.gmatch(ARGV[3], '[^,]+') do if s == cur then ok = true end end
if not ok then return {0, cur} end
__QUEUED_CAP__
local n = tonumber(ARGV[7])
for i = 8, 7 + n do redis.call('HDEL', KEYS[1], ARGV[i]) end
redis.call('HDEL', KEYS[6], 'summary')
for i = 8 + n, #ARGV, 2 do redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 1]) end
-- the starts so far are the ended run's: TLAB_MAX_ATTEMPTS bounds the rerun's own (preempting.failed_attempts)
local started = tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0')
  - tonumber(redis.call('HGET', KEYS[1], 'preemptions') or '0')
redis.call('HSET', KEYS[1], 'state', 'queued', 'updated_at', ARGV[2], 'attempts_before_rerun', tostring(started))
redis.call('ZADD', KEYS[2], tonumber(ARGV[2]), ARGV[1])
for _, entry in ipairs(redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1000)) do
  local f = entry[2]
  for i = 1, #f, 2 do
    if f[i] == 'kind' and f[i + 1] == 'end' then redis.call('XDEL', KEYS[3], entry[1]) end
  end
end
ours(KEYS[1], KEYS[3], __MAXLEN__, 'status',
     cjson.encode({kind = 'status', state = 'queued', at = tonumber(ARGV[2]), reason = ARGV[4]}))
redis.call('LPUSH', KEYS[4], ARGV[1])
redis.call('LTRIM', KEYS[4], 0, 0)
return {1, cur}
""".replace("__QUEUED_CAP__", QUEUED_CAP).replace("__MAXLEN__", str(STREAM_MAXLEN))

# KEYS: job hash, all-jobs index, the owner's jobs index, the queue view, then the job's own keys (keys.job_keys)
# ARGV: job id, comma-separated states it may be deleted in (the terminal ones)
# Deletes an ended job's record in one step (service/api/deleting.py): a sweep rerun cannot move it back to the queue
# half-way. Returns 1, or the job's state when it may not be deleted ('missing' when there is none).
DELETE_ENDED = """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return 'missing' end
if not string.find(',' .. ARGV[2] .. ',', ',' .. cur .. ',', 1, true) then return cur end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
for i = 5, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('DEL', KEYS[1])
return 1
"""
