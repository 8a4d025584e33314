"""Experiments: submit (or dry-run), list, get, cancel, delete, follow (SSE), metrics, plot (logs: ``routes.logs``)."""

from __future__ import annotations

import io
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import WithJsonSchema

from api_schemas.jobs import DryRun, ExperimentSubmit, JobList, JobView, MetricsView, UserPublic
from api_schemas.lineage import ContinueRequest, ForkRequest
from api_schemas.sweeps import SweepSubmit
from service.api.admission import admit_experiment
from service.api.deleting import delete_job
from service.api.deps import CurrentUser, JobFilterDep, PageDep, State, StateDep, StreamToken, StreamUser, own_job
from service.api.dry_run import dry_run_answer
from service.api.enqueue import dry_run_view, enqueue, known_nodes, never_fits
from service.api.events import STREAM_ID_PATTERN, downsample, follow, records, valid_stream_id
from service.api.lineage import continue_job, curve_records, fork_job
from service.api.responses import AUTHED, LISTED, OWNED, STREAMS, SUBMIT, error
from service.api.strict import strict_json
from service.api.views import list_jobs, metrics_csv
from service.core.errors import DoesNotFit, InvalidInput
from service.core.store import demand_of

router = APIRouter(prefix="/v1/experiments", tags=["experiments"], responses=AUTHED)
IdempotencyKey = Annotated[str | None, Header(max_length=200)]
# the pattern in the schema is what ``event_stream`` checks (its 422 names Last-Event-ID and shows one); the schema
# says a string, never null (a header is absent or a string)
LastEventId = Annotated[str | None, WithJsonSchema({"type": "string", "maxLength": 64, "pattern": STREAM_ID_PATTERN}),
                        Header(max_length=64, description="resume after this stream id (1712345678901-0)")]
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}  # proxies: no buffer


def queue_job(st: State, user: UserPublic, body: ExperimentSubmit | SweepSubmit, response: Response,
              idempotency_key: str | None) -> JobView:
    """Queue it; an Idempotency-Key replay answers 200 with the original job."""
    job, created = enqueue(st.store, user, body, idempotency_key)
    if created:
        st.submissions.inc()
    else:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return job


def event_stream(st: State, user: UserPublic, job_id: str, last_event_id: str | None, token: str
                 ) -> StreamingResponse:
    """The job's stream as SSE: history after ``last_event_id`` (all if None), then live events, while ``token``
    still signs in (a rotation or a disable ends it); one of the user's capped open streams."""
    if last_event_id is not None and not valid_stream_id(last_event_id):
        raise InvalidInput("Last-Event-ID must be a stream id like 1712345678901-0", field="Last-Event-ID")
    stream = follow(st.hub, job_id, last_event_id, st.settings.heartbeat_s, lambda: st.still_valid(token))
    return StreamingResponse(st.count_stream(user.name, stream), media_type="text/event-stream",
                             headers=SSE_HEADERS)


def job_records(st: State, job_id: str) -> list[dict[str, Any]]:
    return records(st.store.events(job_id))


@router.post("", status_code=201, response_model=JobView | DryRun,
             dependencies=[Depends(strict_json(ExperimentSubmit))],
             responses={200: {"description": "an Idempotency-Key replay (the original job), or a dry run"}} | SUBMIT
             | {503: error("a dry run of a spec with your code, and Ray is not reachable")})
def submit(body: ExperimentSubmit, st: StateDep, user: CurrentUser, response: Response, dry_run: bool = False,
           idempotency_key: IdempotencyKey = None) -> JobView | DryRun:
    """Queue an experiment (or, with ``dry_run=true``, say whether and where it would fit; a spec that runs your
    code also gets its preflight, run on Ray within ``TLAB_PREFLIGHT_TIMEOUT_S``: 422 with its one line if it fails)."""
    body = admit_experiment(st.settings, user, body)
    demand = demand_of(body)
    view, _ = st.cluster_view()
    nodes = known_nodes(st.settings.cluster_nodes, view)
    if dry_run:  # a spec that runs the user's code: its preflight on Ray, inside the request (422: its one line)
        response.status_code = 200
        return dry_run_answer(st.settings, st.store.r, user, body.spec, dry_run_view(demand, view, nodes))
    why = never_fits(demand, nodes)
    if why:
        raise DoesNotFit(f"this experiment can never fit the cluster: {why}", field="spec.resources")
    return queue_job(st, user, body, response, idempotency_key)


@router.get("", responses=LISTED)
def list_experiments(st: StateDep, user: CurrentUser, flt: JobFilterDep, page: PageDep) -> JobList:
    """Your experiments, newest first (admins: everyone's, or ``owner=``); filter by state and tag."""
    return list_jobs(st.store, user, "experiment", flt, page)


@router.get("/{job_id}", responses=OWNED)
def get_experiment(job_id: str, st: StateDep, user: CurrentUser) -> JobView:
    """One experiment: state, why it is pending, progress, summary or failure reason."""
    return st.store.view(job_id, own_job(st, user, job_id))


@router.post("/{job_id}/cancel", status_code=202, summary="Cancel an experiment; its record stays readable",
             responses=OWNED | {409: error("the experiment has already ended: nothing to cancel")})
def cancel(job_id: str, st: StateDep, user: CurrentUser) -> JobView:
    """A queued experiment leaves the queue and is `cancelled` at once; a starting or running one is stopped
    (SIGTERM, then SIGKILL after the grace) and becomes `cancelled` shortly after (the 202 shows its state now). Its
    record, metrics, logs and artifacts stay (DELETE removes them). An experiment that has already ended answers
    409."""
    own_job(st, user, job_id)
    st.store.cancel(job_id)
    return st.store.view(job_id)


@router.delete("/{job_id}", status_code=204, response_class=Response,
               summary="Delete an ended experiment: its record, metrics, logs, checkpoints and artifacts",
               responses=OWNED | {204: {"description": "deleted: its id answers 404 from now on"},
                                  409: error("it has not ended (cancel it first), or an experiment continued or "
                                             "forked from it has not ended yet")})
def delete(job_id: str, st: StateDep, user: CurrentUser) -> Response:
    """Everything the experiment left goes, in Redis and in storage; GET answers 404 from then on."""
    delete_job(st.store, st.settings, own_job(st, user, job_id), "experiments")
    return Response(status_code=204)


@router.get("/{job_id}/events",
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "SSE: metric, teleport, status, log, end"}} | OWNED | STREAMS)
async def events(job_id: str, st: StateDep, user: StreamUser, token: StreamToken,
                 last_event_id: LastEventId = None) -> StreamingResponse:
    """Server-Sent Events: history, then live; ``Last-Event-ID`` resumes after that stream id."""
    await run_in_threadpool(own_job, st, user, job_id)
    return event_stream(st, user, job_id, last_event_id, token)


@router.get("/{job_id}/metrics", responses={200: {"content": {"text/csv": {}}}} | OWNED)
def get_metrics(job_id: str, st: StateDep, user: CurrentUser,
                max_points: Annotated[int | None, Query(ge=1, le=100_000)] = None,
                format: Literal["json", "csv"] = "json") -> Any:
    """Per-epoch metrics (downsampled to ``max_points``), and the teleport reports; ``format=csv`` for a table."""
    own_job(st, user, job_id)
    recs = curve_records(st.store, job_id)  # a continued or forked run: its ancestors' epochs first
    rows = [r for r in recs if r.get("kind") == "epoch"]
    points = downsample(rows, max_points)
    if format == "csv":
        return Response(metrics_csv(points), media_type="text/csv")
    return MetricsView(id=job_id, total_points=len(rows), points=points,
                       teleports=[r for r in recs if r.get("kind") == "teleport"])


@router.get("/{job_id}/plot.png", responses={200: {"content": {"image/png": {}}}} | OWNED | {
    422: error("more than TLAB_MAX_COMPARE runs, or an invalid x")})
def plot(job_id: str, st: StateDep, user: CurrentUser,
         compare: Annotated[str | None, Query(max_length=2000, description="more ids, comma-separated")] = None,
         x: Annotated[Literal["both", "epoch", "seconds"], Query(
             description="x axis: both (train loss against epochs and against wall-clock seconds, teleport time "
                         "shaded), epochs trained, or wall-clock seconds (teleport included)")] = "both",
         ) -> Response:
    """Train/test loss (teleports marked); ``compare=id2,id3`` overlays other experiments, ``x=seconds`` on time."""
    from plots.curves import plot_curves

    ids = list(dict.fromkeys([job_id] + [i.strip() for i in (compare or "").split(",") if i.strip()]))
    if len(ids) > st.settings.max_compare:
        raise InvalidInput(f"{len(ids)} runs in one plot; at most {st.settings.max_compare} (TLAB_MAX_COMPARE): "
                           "compare fewer", field="compare")
    runs = {}
    for i in ids:
        name = own_job(st, user, i).get("name") or i
        runs[name if name not in runs else f"{name} ({i})"] = curve_records(st.store, i)
    buf = io.BytesIO()
    plot_curves(runs, buf, title=None, fmt="png", x=x)
    return Response(buf.getvalue(), media_type="image/png")


LINEAGE = OWNED | SUBMIT | {409: error("the experiment has not ended, kept no checkpoint, or (fork) kept none after "
                                      "from_epoch; or the Idempotency-Key was used before with another body")}


def _child(response: Response, made: tuple[JobView, bool]) -> JobView:
    job, created = made
    if not created:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return job


@router.post("/{job_id}/continue", status_code=201, dependencies=[Depends(strict_json(ContinueRequest))],
             responses={200: {"description": "an Idempotency-Key replay (the original child)"}} | LINEAGE)
def continue_experiment(job_id: str, body: ContinueRequest, st: StateDep, user: CurrentUser, response: Response,
                        idempotency_key: IdempotencyKey = None) -> JobView:
    """A new experiment (yours) that trains ``epochs`` more from the ended experiment's final checkpoint: its
    spec is the parent's with ``training.epochs`` = the final checkpoint's epoch + ``epochs``, its epochs go on
    from the parent's, and ``parent``/``parent_epoch`` link them."""
    return _child(response, continue_job(st, user, job_id, body, idempotency_key))


@router.post("/{job_id}/fork", status_code=201, dependencies=[Depends(strict_json(ForkRequest))],
             responses={200: {"description": "an Idempotency-Key replay (the original child)"}} | LINEAGE)
def fork_experiment(job_id: str, body: ForkRequest, st: StateDep, user: CurrentUser, response: Response,
                    idempotency_key: IdempotencyKey = None) -> JobView:
    """A new experiment (yours) from the ended experiment's checkpoint after ``from_epoch`` (one it kept: a 409
    lists them), with the ``set`` fields changed; model, dataset, code, training.dtype and optimizer.name
    cannot change across a checkpoint (422 naming the field)."""
    return _child(response, fork_job(st, user, job_id, body, idempotency_key))
