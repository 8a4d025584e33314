"""Sweeps: submit, list, get (with the trials table), cancel, follow (SSE), plot, the seed-study table."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api_schemas.jobs import JobList, JobView, StudyView, SweepView
from api_schemas.sweeps import SweepSubmit
from service.admission import admit_sweep
from service.deps import CurrentUser, JobFilterDep, PageDep, StateDep, StreamToken, StreamUser, own_sweep
from service.errors import DoesNotFit
from service.routes.experiments import IdempotencyKey, LastEventId, event_stream, job_records, queue_job
from service.store import demand_of
from service.studies import best_trial, study_view, sweep_png, trial_rows
from service.submit import known_nodes, never_fits
from service.views import list_jobs

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"])


@router.post("", status_code=201,
             responses={200: {"description": "an Idempotency-Key replay"}, 409: {"description": "key reused"},
                        413: {"description": "the body is over TLAB_MAX_BODY_BYTES"},
                        422: {"description": "a bad search space (the path is named), a base spec or axis value "
                                             "refused at admission, or a gang that never fits"},
                        429: {"description": "max_queued_jobs reached: see Retry-After"}})
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


@router.get("")
def list_sweeps(st: StateDep, user: CurrentUser, flt: JobFilterDep, page: PageDep) -> JobList:
    """Your sweeps, newest first."""
    return list_jobs(st.store, user, "sweep", flt, page)


@router.get("/{sweep_id}")
def get_sweep(sweep_id: str, st: StateDep, user: CurrentUser) -> SweepView:
    """The sweep's state, its trials table (config, state, last/best metric, epochs, stopped early), the best."""
    data = own_sweep(st, user, sweep_id)
    sweep = SweepSubmit.model_validate_json(data["sweep"])
    rows = trial_rows(st.store, sweep_id)
    return SweepView(job=st.store.view(sweep_id, data), metric=sweep.metric, mode=sweep.mode, trials=rows,
                     best=best_trial(rows, sweep.mode))


@router.delete("/{sweep_id}", status_code=202, responses={409: {"description": "already ended"}})
def cancel_sweep(sweep_id: str, st: StateDep, user: CurrentUser) -> JobView:
    """Cancel a sweep: its Ray job (the Tune driver, and with it every trial) is stopped."""
    own_sweep(st, user, sweep_id)
    st.store.cancel(sweep_id)
    return st.store.view(sweep_id)


@router.get("/{sweep_id}/events",
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "every trial's events (data.trial), then end"},
                       429: {"description": "TLAB_MAX_STREAMS_PER_USER streams open: see Retry-After"}})
async def sweep_events(sweep_id: str, st: StateDep, user: StreamUser, token: StreamToken,
                       last_event_id: LastEventId = None) -> StreamingResponse:
    """SSE of every trial's events, tagged with the trial id; resumable with ``Last-Event-ID``."""
    await run_in_threadpool(own_sweep, st, user, sweep_id)
    return event_stream(st, user, sweep_id, last_event_id, token)


@router.get("/{sweep_id}/plot.png", responses={200: {"content": {"image/png": {}}}})
def sweep_plot(sweep_id: str, st: StateDep, user: CurrentUser) -> Response:
    """Every trial's curves; with ``training.seed`` in the space, mean ± std bands per setting of the rest."""
    sweep = SweepSubmit.model_validate_json(own_sweep(st, user, sweep_id)["sweep"])
    png = sweep_png(sweep_id, sweep, job_records(st, sweep_id), trial_rows(st.store, sweep_id))
    return Response(png, media_type="image/png")


@router.get("/{sweep_id}/study")
def sweep_study(sweep_id: str, st: StateDep, user: CurrentUser) -> StudyView:
    """The paper-style table: per setting of the non-seed parameters, mean ± std over seeds of the final
    train/test loss and accuracy, epochs and seconds to ``training.target_loss``, teleport's share of time."""
    sweep = SweepSubmit.model_validate_json(own_sweep(st, user, sweep_id)["sweep"])
    return study_view(sweep_id, sweep, trial_rows(st.store, sweep_id))
