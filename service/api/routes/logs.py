"""Logs: what every process of a job printed, kept in storage (``service.api.job_logs``), as text or followed (SSE)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import WithJsonSchema

from api_schemas import keys
from api_schemas.jobs import TERMINAL, JobState
from service.api import job_logs
from service.api.deps import CurrentUser, StateDep, StreamToken, StreamUser, own_job
from service.api.responses import AUTHED, OWNED, STREAMS
from service.api.routes.experiments import SSE_HEADERS, job_records
from service.api.views import log_text
from service.core import storage

router = APIRouter(prefix="/v1/experiments", tags=["logs"], responses=AUTHED)
Rank = Annotated[str, Query(pattern=r"^(\d{1,4}|driver|preflight|trial-[0-9a-z_]{1,40})$", description="a worker's "
                            "rank, `driver` (the Ray job's entrypoint; rank 0 of a 1-worker job, which trains there), "
                            "`preflight` (attempt 1 only: the code tried on one CPU before the gang) or `trial-<id>` "
                            "(a sweep's 1-worker trial, which trains in its Tune trial)")]
Attempt = Annotated[int | None, Query(ge=1, le=10_000, description="which start of the job (default: the newest)")]
Tail = Annotated[int | None, Query(ge=0, le=100_000, description="only the last N lines")]
CURSOR_PATTERN = r"^[0-9]{1,6}:[0-9]{1,15}$"  # what ``job_logs.parse_cursor`` reads (its 422 names Last-Event-ID)
# the schema says the header is this string (a header is never null: absent is the default), as /events says of its own
LogCursor = Annotated[str | None, WithJsonSchema({"type": "string", "pattern": CURSOR_PATTERN}),  # (22 at most)
                     Header(max_length=24, description="resume after this event's id (`<attempt>:<byte offset>`)")]


@router.get("/{job_id}/logs", response_class=PlainTextResponse, responses=OWNED)
def logs(job_id: str, st: StateDep, user: CurrentUser, rank: Rank = "0", attempt: Attempt = None,
         tail: Tail = None) -> str:
    """What the rank printed (stdout and stderr), kept in storage: readable after Ray forgot the job and after a
    cluster restart. A job that kept none (it never started, or ran before logs were kept): the Ray driver's log
    while Ray still has it, then the job's log events."""
    sid = own_job(st, user, job_id).get("ray_job_id")
    storage.sync_logs(st.settings, job_id)  # with a bucket: what the local copy lacks
    chosen = job_logs.pick_attempt(st.settings.storage_path, job_id, attempt)
    if chosen is not None:
        return job_logs.tail(st.settings.storage_path, job_logs.file_of(st.settings.storage_path, job_id, rank, chosen),
                             tail)
    return log_text(ray_driver_log(st, sid), job_records(st, job_id))


def ray_driver_log(st: StateDep, sid: str | None) -> str | None:
    if not sid:
        return None
    try:
        return st.ray_jobs().logs(sid)
    except Exception:  # Ray forgot the job, or the head is down: the events still say what happened
        return None


@router.get("/{job_id}/logs/stream",
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "SSE: `log` events (data: the new lines; id: attempt:offset), `end`"}}
            | OWNED | STREAMS)
async def follow_logs(job_id: str, st: StateDep, user: StreamUser, token: StreamToken, rank: Rank = "0",
                      last_event_id: LogCursor = None) -> StreamingResponse:
    """Follow the rank's log as it is written, across the job's restarts; ``Last-Event-ID`` resumes at that byte.
    Ends (event ``end``) when the job has ended and its log is read to the end."""
    await run_in_threadpool(own_job, st, user, job_id)
    cursor = job_logs.parse_cursor(last_event_id)

    async def ended() -> bool:
        state = await st.aredis.hget(keys.job(job_id), "state")
        return state is None or JobState(state) in TERMINAL

    refresh = (lambda: storage.sync_logs(st.settings, job_id)) if st.settings.storage_uri else None
    stream = job_logs.follow(st.settings.storage_path, job_id, rank, cursor, ended,
                             lambda: st.still_valid(token), st.settings.heartbeat_s, refresh)
    return StreamingResponse(st.count_stream(user.name, stream), media_type="text/event-stream",
                             headers=SSE_HEADERS)
