"""Every Redis key name in one place (the service, the scheduler and the workers share them)."""

PREFIX = "tlab"


def job(job_id: str) -> str:
    """Hash: the job's state, owner, spec (JSON), timestamps, failure reason, summary."""
    return f"{PREFIX}:job:{job_id}"


def events(job_id: str) -> str:
    """Stream: the job's metric, teleport, status and log events, in order (XADD, capped)."""
    return f"{PREFIX}:job:{job_id}:events"


def queue() -> str:
    """Sorted set of queued job ids."""
    return f"{PREFIX}:queue"


def user_jobs(user: str) -> str:
    return f"{PREFIX}:user:{user}:jobs"


EVENT_KINDS = ("metric", "teleport", "status", "log", "end")
STREAM_MAXLEN = 100_000  # events kept per job; history is downsampled on read, never here


def emitted(job_id: str) -> str:
    """Hash of event identities already in the stream (``epoch:5``, ``teleport:0:12``): exactly-once."""
    return f"{PREFIX}:job:{job_id}:emitted"


def job_keys(job_id: str) -> list[str]:
    """Every key of one job the service names, but its hash (what deleting it removes, with the hash and whatever
    else ``job_key_pattern`` finds)."""
    return [events(job_id), emitted(job_id), trials(job_id), notified(job_id), job_run(job_id), preflight(job_id)]


def own_keys(job_id: str) -> list[str]:
    """The keys a job's own Redis user may touch, exactly these (service/launch/job_acl.py): its events stream and
    emitted hash first (the sink's script writes them), then its trials, ``run`` and preflight hashes. Never its job
    hash, nor ``notified``."""
    return [events(job_id), emitted(job_id), trials(job_id), job_run(job_id), preflight(job_id)]


def glob_escape(name: str) -> str:
    """``name`` as a Redis glob that matches it alone (an ACL key pattern, a SCAN MATCH)."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in name)


def job_key_pattern(job_id: str) -> str:
    """SCAN MATCH pattern of every key under the job's hash (``tlab:job:<id>:*``): what deleting it sweeps."""
    return f"{glob_escape(job(job_id))}:*"


def unsettled() -> str:
    """Set of jobs that ended from the queue after having run (a preempted job cancelled while it waited): their
    files were never pruned nor counted; the scheduler does both (``service.core.storage_lifecycle.settle``)."""
    return f"{PREFIX}:storage:unsettled"


def storage_usage() -> str:
    """Hash written by the scheduler: user name -> bytes their jobs hold in storage (the max_storage_gb quota)."""
    return f"{PREFIX}:storage:usage"


def jobs() -> str:
    """Sorted set (all scores 0) of every job id; ids sort by creation time, so ZREVRANGEBYLEX pages newest first."""
    return f"{PREFIX}:jobs"


def active() -> str:
    """Set of job ids in ``starting`` or ``running``: what the scheduler reconciles with Ray."""
    return f"{PREFIX}:active"


def users() -> str:
    """Hash: user name -> UserPublic JSON."""
    return f"{PREFIX}:users"


def token(token_hash: str) -> str:
    """String: sha256 of a bearer token -> user name (tokens themselves are never stored)."""
    return f"{PREFIX}:token:{token_hash}"


def usage() -> str:
    """Hash: user name -> JSON {"value", "at"}: decayed GPU/CPU usage for fair share."""
    return f"{PREFIX}:usage"


def idempotency(user: str, key: str) -> str:
    """String: ``job_id|body_sha256`` for an ``Idempotency-Key`` of a user (expires after a day)."""
    return f"{PREFIX}:idem:{user}:{key}"


def cluster() -> str:
    """String: the scheduler's last view of the cluster (ClusterView JSON), for the API to show."""
    return f"{PREFIX}:cluster"


def scheduler_lock() -> str:
    """String with a TTL: the running scheduler's id (one scheduler decides at a time)."""
    return f"{PREFIX}:scheduler:lock"


def wake() -> str:
    """List the API pushes to after a submit or cancel so the scheduler decides at once (BLPOP)."""
    return f"{PREFIX}:scheduler:wake"


def queue_view() -> str:
    """Hash written by the scheduler after each decision: queued job id -> JSON {position, reason}."""
    return f"{PREFIX}:queue:view"


def trials(job_id: str) -> str:
    """Hash of a sweep's trials: trial id -> JSON row (config, state, last/best metric, epochs, stopped early)."""
    return f"{PREFIX}:job:{job_id}:trials"


def user_token(name: str) -> str:
    """String: sha256 of the user's current token; a token whose hash is not this one is refused (rotated)."""
    return f"{PREFIX}:user:{name}:token"


def auth_generation() -> str:
    """Counter bumped on every token rotation and user change: API processes drop cached logins when it moves."""
    return f"{PREFIX}:auth:generation"


# what service.core.store.new_job_id makes; checked before any key use
JOB_ID_PATTERN = r"^[0-9a-f]{11,16}-[0-9a-f]{6}$"


def user_queued(user: str) -> str:
    """Sorted set of a user's jobs submitted and perhaps still queued (pruned at their next submit): the
    ``max_queued_jobs`` quota's count."""
    return f"{PREFIX}:user:{user}:queued"


def notify_outbox() -> str:
    """Stream: webhook notifications to send (job id, state, reason), added by the transition script."""
    return f"{PREFIX}:notify:outbox"


def notify_cursor() -> str:
    """String: the last outbox entry the scheduler's sender has taken (it resumes after it on a restart)."""
    return f"{PREFIX}:notify:cursor"


def notified(job_id: str) -> str:
    """Hash: ``state:attempt`` -> when its webhook was taken for sending: at most one POST per state change."""
    return f"{PREFIX}:job:{job_id}:notified"


def webhook_secret(user: str) -> str:
    """String: the user's webhook signing secret (made on first use)."""
    return f"{PREFIX}:user:{user}:webhook_secret"


def acl_secret() -> str:
    """String: the scheduler's random secret; a job's Redis password is HMAC(it, the Ray submission id)."""
    return f"{PREFIX}:acl:secret"


def job_run(job_id: str) -> str:
    """Hash: the job's record as its own processes see it (spec, sweep, start_from, attempts: the scheduler's copy
    before each submit; summary: written by the job, copied into the job hash when it ends; ``JOB_RUN_CAPS``: the
    caps of the job's bounded writes). A job's Redis user may touch ``own_keys`` only, never the job hash
    (service/launch/job_acl.py, workers/job/record.py)."""
    return f"{PREFIX}:job:{job_id}:run"


JOB_RUN_MARK = "job"  # job_run's field naming its job: there once the scheduler wrote the copy
JOB_RUN_CAPS = "redis_caps"  # job_run's field "<bytes per entry>,<bytes of all own_keys>" (api_schemas.redis_scripts)


def ticket(user: str) -> str:
    """String: a job's own ``REDIS_URL``, read once and deleted (``GETDEL``) by its first process as the ticket's
    Redis user ``user`` (``tlab-ticket-job-<id>``); none of any job's ``own_keys``, so no job's user can read it
    (service/launch/job_acl.py, workers/job/ticket.py)."""
    return f"{PREFIX}:ticket:{user}"


JOB_TICKET_ENV = "TLAB_JOB_TICKET"  # the runtime_env variable with the ticket: the ticket user's Redis URL


def preflight(job_id: str) -> str:
    """Hash: the verdict the job's preflight wrote (``result``: PreflightResult JSON), as its own Redis user."""
    return f"{PREFIX}:job:{job_id}:preflight"


def preflights() -> str:
    """Set of job ids whose preflight the scheduler has started and not yet settled (found again after a restart;
    a cancelled job's preflight is stopped from here)."""
    return f"{PREFIX}:preflights"


def hub_wake(hub_id: str) -> str:
    """Stream (one entry, expiring): an API process's event reader is woken through it when a job is first
    followed, so its single blocked XREAD over every followed job starts again with that job in it."""
    return f"{PREFIX}:hub:{hub_id}:wake"


def join_tokens() -> str:
    """Hash: join token id -> JSON {sha256 of the token, note, created_at}; a token not here is refused (revoked)."""
    return f"{PREFIX}:join_tokens"


def nodes_joined() -> str:
    """Hash: the address a node joined from -> the id of the join token it joined with; only that token may join
    again from there or take that node out (``tlab leave``). An entry goes when its token is revoked
    (service/core/join_tokens.py)."""
    return f"{PREFIX}:nodes:joined"


def nodes_leaving() -> str:
    """Hash: the address of a node leaving the cluster (``tlab leave``) -> JSON {hostname, address, since, until}. The
    scheduler places nothing there and stops the jobs placed there; an entry goes when a node joins again from that
    address, or once ``until`` is past (service/core/nodes_leaving.py)."""
    return f"{PREFIX}:nodes:leaving"
