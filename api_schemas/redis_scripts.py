"""Lua scripts, in one module: each is atomic on the Redis server and safe to repeat."""

import hashlib
from collections.abc import Mapping

from api_schemas.keys import STREAM_MAXLEN

OUTBOX_MAXLEN = 10_000  # webhook entries kept in the outbox (the sender takes them within a tick)

# A job's own writes (its events, its `run`, trials and preflight hashes) go through scripts the service loaded, which
# its Redis user runs with EVALSHA (service/launch/job_acl.py): each refuses, before writing anything, an entry over
# the per-entry cap and a write that would take the job's keys over its share of Redis. Both caps are in the script's
# text (`write_caps`), so a job cannot choose them: it may run no script but those the service loaded. Refusals are
# error replies starting with `OVER_CAP`.
JOB_REDIS_MB = 64.0  # TLAB_JOB_REDIS_MB's default: the caps of a job run without the scheduler (no `run` copy)
ENTRY_MAX = 1 << 20  # bytes an entry (a field and its value, an event's identity, kind and data) may have at most
ENTRY_MIN = 4096  # ... and at least, however small the job's share
PER_ENTRY = 64  # bytes counted for each entry besides its own (Redis's bookkeeping of it)
OVER_CAP = "OVERCAP"
ENDED = "ATTEMPTENDED"  # the error reply of a write whose attempt the job's record has moved past (fencing)
OWN_KEYS = 5  # len(keys.own_keys): a fenced write's KEYS may add the job hash after them (no run copy)


def write_caps(job_redis_mb: float = JOB_REDIS_MB) -> tuple[int, int]:
    """(bytes per entry, bytes of the job's keys together) for a share of ``job_redis_mb`` MiB: an entry may take a
    sixteenth of the share, between ``ENTRY_MIN`` and ``ENTRY_MAX``."""
    share = int(job_redis_mb * 2**20)
    return max(ENTRY_MIN, min(ENTRY_MAX, share // 16)), share


def parse_caps(raw: object) -> tuple[int, int]:
    """``write_caps`` from their text in the job's ``run`` copy ("entry,share"); the default's when absent."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw or "")
    try:
        entry, share = (int(x) for x in text.split(","))
    except ValueError:
        return write_caps()
    return entry, share


# KEYS: the job's own keys (keys.own_keys), its events stream first; the room is measured over all of them as the
# scheduler's tick measures them (service/launch/job_caps.py): the stream whole (MEMORY USAGE ... SAMPLES 0: one step
# per node; a sample would be of its first nodes only), each hash by a sample of 5 fields.
_BOUND = """local ENTRY, SHARE, PER = __ENTRY__, __SHARE__, __PER__
local function too_big(size, what)
  if size > ENTRY then
    return redis.error_reply(string.format('__OVER__ %s of %d bytes refused: over the cap of %d bytes per entry '
      .. '(from TLAB_JOB_REDIS_MB); write smaller ones', what, size, ENTRY))
  end
end
local function no_room(incoming)
  local used = 0
  for i = 1, math.min(#KEYS, __OWN__) do
    used = used + (redis.call('MEMORY', 'USAGE', KEYS[i], 'SAMPLES', i == 1 and '0' or '5') or 0)
  end
  if used + incoming > SHARE then
    return redis.error_reply(string.format("__OVER__ this job's keys take %d bytes of Redis; %d more would pass its "
      .. 'share of %d (TLAB_JOB_REDIS_MB): the write is refused; write fewer or smaller events', used, incoming,
      SHARE))
  end
end
"""

# KEYS[1] = events stream, KEYS[2] = emitted hash, then the job's other keys; ARGV = maxlen, then (identity, kind,
# data) triples. An event whose identity is already in the hash is skipped, so a worker restarted from a checkpoint
# can re-emit the epochs it redoes without duplicating them. Identity "" = always add. The whole batch is refused,
# nothing written, when one event is over the entry cap or the batch would pass the job's share.
_XADD_ONCE = """
local incoming = 0
for i = 2, #ARGV, 3 do
  local size = #ARGV[i] + #ARGV[i + 1] + #ARGV[i + 2]
  local refused = too_big(size, 'an event (' .. string.sub(ARGV[i + 1], 1, 20) .. ')')
  if refused then return refused end
  incoming = incoming + size + PER
end
local refused = no_room(incoming)
if refused then return refused end
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

# KEYS = the job's own keys; ARGV[1] = the position in KEYS of the hash written, then field/value pairs.
# A field's growth is its new value less the one it replaces; refused whole as the events are.
_HSET_OWN = """
local key, growth, fields = KEYS[tonumber(ARGV[1])], 0, {}
for i = 2, #ARGV, 2 do
  local size = #ARGV[i] + #ARGV[i + 1]
  local refused = too_big(size, 'field ' .. string.sub(ARGV[i], 1, 40))
  if refused then return refused end
  growth = growth + size + PER - redis.call('HSTRLEN', key, ARGV[i])
  fields[#fields + 1], fields[#fields + 2] = ARGV[i], ARGV[i + 1]
end
if growth > 0 then
  local refused = no_room(growth)
  if refused then return refused end
end
return redis.call('HSET', key, unpack(fields))
"""


# Fencing (docs/security.md, "Fencing"): a write made by a job's attempt carries that attempt in its script's text
# (as the caps are: the service loaded the script, so the job cannot choose another); `ended()` compares it with the
# job's record in the same atomic step as the write. The record is the job's `run` copy (KEYS[4]: the scheduler writes
# its `attempts` before each submit and deletes it once the job is no longer starting or running) or, for a job
# without one (no Redis users: TLAB_JOB_REDIS_ACL=off, a job run by hand), the job hash itself, named after the own
# keys (KEYS[6]), whose state must also be starting or running. An attempt of '' is not fenced (a preflight, a trial).
_FENCE = """local ATTEMPT = '__ATTEMPT__'
local function ended()
  if ATTEMPT == '' then return nil end
  local copy = #KEYS <= __OWN__
  local f = redis.call('HMGET', copy and KEYS[4] or KEYS[__OWN__ + 1], 'attempts', 'state', 'job')
  local cur, why = f[1] or '1', nil
  if copy and not f[3] then why = 'its run record is gone'
  elseif cur ~= ATTEMPT then why = 'the job is on attempt ' .. cur
  elseif f[2] and f[2] ~= 'starting' and f[2] ~= 'running' then why = 'the job is ' .. f[2] end
  if why then
    return redis.error_reply('__ENDED__ attempt ' .. ATTEMPT .. ' of this job has ended (' .. why
      .. '): its write is refused')
  end
end
"""
_FENCED = """local refused = ended()
if refused then return refused end
"""
# KEYS: the job's own keys, then the job hash; ARGV: field/value pairs. The fenced write of a job without a run copy.
_HSET_JOB = """return redis.call('HSET', KEYS[__OWN__ + 1], unpack(ARGV))
"""


def _fence(attempt: int | None) -> str:
    return (_FENCE.replace("__ATTEMPT__", "" if attempt is None else str(int(attempt)))
            .replace("__ENDED__", ENDED).replace("__OWN__", str(OWN_KEYS)))


def _bounded(body: str, caps: tuple[int, int], attempt: int | None = None) -> str:
    entry, share = caps
    return (_fence(attempt) + _BOUND.replace("__ENTRY__", str(int(entry))).replace("__SHARE__", str(int(share)))
            .replace("__PER__", str(PER_ENTRY)).replace("__OVER__", OVER_CAP).replace("__OWN__", str(OWN_KEYS))
            + _FENCED + body)


def xadd_once(caps: tuple[int, int], attempt: int | None = None) -> str:
    """The sink's script (events, exactly once per identity) with these ``write_caps``, fenced to ``attempt``."""
    return _bounded(_XADD_ONCE, caps, attempt)


def hset_own(caps: tuple[int, int], attempt: int | None = None) -> str:
    """The script of a job's hash writes (its ``run`` copy, trials, preflight) with these ``write_caps``, fenced to
    ``attempt``."""
    return _bounded(_HSET_OWN, caps, attempt)


def fence_check(attempt: int) -> str:
    """1 while ``attempt`` is the job's current one, else the ``ENDED`` error (KEYS as a fenced write's)."""
    return _fence(attempt) + _FENCED + "return 1\n"


def hset_job(attempt: int) -> str:
    """HSET of the job hash (KEYS[6]) fenced to ``attempt``: a job without a run copy writes its summary so."""
    return _fence(attempt) + _FENCED + _HSET_JOB.replace("__OWN__", str(OWN_KEYS))


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

# KEYS: job hash, queue zset, active set, events stream, notify outbox stream, the job's run copy (optional)
# ARGV: to-state, now, comma-separated states the caller expects the job in ('' = any), reason, field/value pairs.
# Moves the job only along the transition table; keeps the queue and active sets in step; names the new state and
# attempt in the job's run copy while there is one (what the fenced scripts read: an attempt's writes end with it,
# whether or not a tick deleted the copy since); writes a
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
if KEYS[6] and redis.call('HEXISTS', KEYS[6], 'job') == 1 then
  redis.call('HSET', KEYS[6], 'state', to, 'attempts', redis.call('HGET', KEYS[1], 'attempts') or '0')
end
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
