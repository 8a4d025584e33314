"""Liveness, readiness and Prometheus metrics: no token needed."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api_schemas import keys
from service.api.deps import StateDep
from service.api.views import read_cluster_view

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, bool]:
    """Alive (the process answers)."""
    return {"ok": True}


@router.get("/readyz", responses={503: {"description": "Redis or the scheduler is down"}})
def readyz(st: StateDep) -> JSONResponse:
    """Ready: Redis answers and a scheduler has published within the last few ticks."""
    try:
        st.store.r.ping()
    except Exception as err:
        return JSONResponse({"ready": False, "reason": f"redis: {err}"}, status_code=503)
    view, _age = read_cluster_view(st.store, st.settings.tick_s)
    if view is None or not view.scheduler_alive:
        return JSONResponse({"ready": False, "reason": "no scheduler has reported recently"}, status_code=503)
    return JSONResponse({"ready": True})


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(st: StateDep) -> Response:
    """Prometheus metrics: requests, latency, submissions, queue length, active jobs."""
    r = st.store.r
    extra = (f"# TYPE tlab_queue_length gauge\ntlab_queue_length {r.zcard(keys.queue())}\n"
             f"# TYPE tlab_active_jobs gauge\ntlab_active_jobs {r.scard(keys.active())}\n")
    return Response(generate_latest(st.registry) + extra.encode(), media_type=CONTENT_TYPE_LATEST)
