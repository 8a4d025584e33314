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
