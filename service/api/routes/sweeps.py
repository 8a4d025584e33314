"""Sweeps: submit, list, get (with the trials table), cancel, delete, rerun trials, follow (SSE), plot, seed studies."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api_schemas.jobs import JobList, JobView, StudyView, SweepView
from api_schemas.sweeps import SweepRerun, SweepSubmit
from service.api.admission import admit_sweep
from service.api.deleting import delete_job
from service.api.deps import CurrentUser, JobFilterDep, PageDep, StateDep, StreamToken, StreamUser, own_sweep
from service.api.enqueue import known_nodes, never_fits
from service.api.responses import AUTHED, LISTED, OWNED, STREAMS, SUBMIT, error
from service.api.routes.experiments import IdempotencyKey, LastEventId, event_stream, job_records, queue_job
from service.api.strict import strict_json
from service.api.studies import best_trial, study_view, sweep_png, trial_rows
from service.api.sweep_rerun import rerun_sweep, shown_rows
from service.api.views import list_jobs
from service.core.errors import DoesNotFit
from service.core.store import demand_of

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"], responses=AUTHED)


@router.post("", status_code=201, dependencies=[Depends(strict_json(SweepSubmit))],
             responses={200: {"description": "an Idempotency-Key replay: the original sweep"}} | SUBMIT | {
                 422: error("a bad search space (the path is named), a base spec or axis value refused at admission, "
                            "over a service limit or quota, or a gang that can never fit")})
def submit_sweep(body: SweepSubmit, st: StateDep, user: CurrentUser, response: Response,
                 idempotency_key: IdempotencyKey = None) -> JobView:
    """Queue a hyperparameter sweep: one job whose gang is ``max_concurrent_trials`` trials' workers."""
    body = admit_sweep(st.settings, user, body)
    view, _ = st.cluster_view()
    why = never_fits(demand_of(body), known_nodes(st.settings.cluster_nodes, view))
    if why:
        raise DoesNotFit(f"max_concurrent_trials={body.max_concurrent_trials} trials at once can never fit the "
                         f"cluster: {why} (or lower max_concurrent_trials)", field="max_concurrent_trials")
    return queue_job(st, user, body, response, idempotency_key)


@router.get("", responses=LISTED)
def list_sweeps(st: StateDep, user: CurrentUser, flt: JobFilterDep, page: PageDep) -> JobList:
    """Your sweeps, newest first."""
    return list_jobs(st.store, user, "sweep", flt, page)


@router.get("/{sweep_id}", responses=OWNED)
def get_sweep(sweep_id: str, st: StateDep, user: CurrentUser) -> SweepView:
    """The sweep's state, its trials table (config, state, last/best metric, epochs, stopped early), the best."""
    data = own_sweep(st, user, sweep_id)
    sweep = SweepSubmit.model_validate_json(data["sweep"])
    rows = shown_rows(trial_rows(st.store, sweep_id), data["state"])
    return SweepView(job=st.store.view(sweep_id, data), metric=sweep.metric, mode=sweep.mode, trials=rows,
                     best=best_trial(rows, sweep.mode))


@router.post("/{sweep_id}/cancel", status_code=202, summary="Cancel a sweep; its record stays readable",
             responses=OWNED | {409: error("the sweep has already ended: nothing to cancel")})
def cancel_sweep(sweep_id: str, st: StateDep, user: CurrentUser) -> JobView:
    """A queued sweep leaves the queue and is `cancelled` at once; a running one's Ray job (the Tune driver, and
    with it every trial) is stopped and the sweep becomes `cancelled` shortly after (the 202 shows its state now).
    Its record, trials table, metrics and artifacts stay (DELETE removes them). A sweep that has already ended
    answers 409."""
    own_sweep(st, user, sweep_id)
    st.store.cancel(sweep_id)
    return st.store.view(sweep_id)


@router.delete("/{sweep_id}", status_code=204, response_class=Response,
               summary="Delete an ended sweep: its record, trials, metrics, logs, checkpoints and artifacts",
               responses=OWNED | {204: {"description": "deleted: its id answers 404 from now on"},
                                  409: error("the sweep has not ended: cancel it first")})
def delete_sweep(sweep_id: str, st: StateDep, user: CurrentUser) -> Response:
    """Everything the sweep and its trials left goes, in Redis and in storage; GET answers 404 from then on."""
    delete_job(st.store, st.settings, own_sweep(st, user, sweep_id), "sweeps")
    return Response(status_code=204)


@router.post("/{sweep_id}/rerun", status_code=202, dependencies=[Depends(strict_json(SweepRerun))],
             summary="Run failed or cancelled trials of an ended sweep again, inside the same sweep",
             responses=OWNED | SUBMIT | {
                 403: error("another user's sweep, or its user code may no longer run (TLAB_USER_CODE, "
                            "can_submit_code)"),
                 409: error("the sweep has not ended"),
                 422: error("trials: an unknown trial, one that did not fail or get cancelled, or none to rerun; the "
                            "stored sweep over a limit or quota now, or no longer fitting the cluster")})
def rerun_trials(sweep_id: str, body: SweepRerun, st: StateDep, user: CurrentUser) -> JobView:
    """``{trials: "failed"}`` reruns every trial that failed or was cut off when the sweep ended (its row says
    `cancelled`); ``{trials: [id, ...]}`` those. The sweep keeps its id and goes back to `queued`: admitted and
    scheduled as a submit would be, its events stream goes on, each chosen trial resumes from its last checkpoint
    (from scratch if it kept none; an epoch it redoes is recorded once) and its row updates in place (`reruns`
    counts); the best trial and the summary are worked out again over every trial when it ends."""
    data = own_sweep(st, user, sweep_id)
    return rerun_sweep(st, user, sweep_id, data, body)


@router.get("/{sweep_id}/events",
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "every trial's events (data.trial), then end"}} | OWNED | STREAMS)
async def sweep_events(sweep_id: str, st: StateDep, user: StreamUser, token: StreamToken,
                       last_event_id: LastEventId = None) -> StreamingResponse:
    """SSE of every trial's events, tagged with the trial id; resumable with ``Last-Event-ID``."""
    await run_in_threadpool(own_sweep, st, user, sweep_id)
    return event_stream(st, user, sweep_id, last_event_id, token)


@router.get("/{sweep_id}/plot.png", responses={200: {"content": {"image/png": {}}}} | OWNED)
def sweep_plot(sweep_id: str, st: StateDep, user: CurrentUser) -> Response:
    """Every trial's curves; with ``training.seed`` in the space, mean ± std bands per setting of the rest."""
    sweep = SweepSubmit.model_validate_json(own_sweep(st, user, sweep_id)["sweep"])
    png = sweep_png(sweep_id, sweep, job_records(st, sweep_id), trial_rows(st.store, sweep_id))
    return Response(png, media_type="image/png")


@router.get("/{sweep_id}/study", responses=OWNED)
def sweep_study(sweep_id: str, st: StateDep, user: CurrentUser) -> StudyView:
    """The paper-style table: per setting of the non-seed parameters, mean ± std over seeds of the final
    train/test loss and accuracy, epochs and seconds to ``training.target_loss``, teleport's share of time."""
    sweep = SweepSubmit.model_validate_json(own_sweep(st, user, sweep_id)["sweep"])
    return study_view(sweep_id, sweep, trial_rows(st.store, sweep_id))
