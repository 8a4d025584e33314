"""The REST API (FastAPI): thin routes over the Redis store; the scheduler process does the starting.

Run it with ``python -m service.api`` (``TLAB_BIND``/``TLAB_PORT``; 127.0.0.1:8470 by default) or
through ``tlab up``. Every route but ``/healthz``, ``/readyz``, ``/metrics`` and the dashboard's page (``/``,
``/static/``) needs a bearer token; the SSE routes also take it as ``?token=`` (for a browser's EventSource).
"""

from __future__ import annotations

import csv
import io
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from api_schemas import keys
from api_schemas.jobs import (
    ClusterView,
    DryRun,
    ExperimentSubmit,
    JobList,
    JobState,
    JobView,
    MetricsView,
    QueueEntry,
    QueueView,
    Role,
    StudyGroup,
    StudyView,
    SweepView,
    TrialRow,
    UserCreate,
    UserCreated,
    UserPublic,
)
from api_schemas.presets import PRESET_NOTES, PRESETS
from api_schemas.sweeps import SweepSubmit
from service import policy
from service.errors import DoesNotFit, Forbidden, InvalidInput, JobNotFound, ServiceError
from service.events import Hub, downsample, follow, records, valid_stream_id
from service.ray_cluster import StaticCluster
from service.settings import Settings
from service.store import Store, demand_of

USER_CACHE_S = 5.0  # a token's user is looked up at most this often per API process
WEB_DIR = Path(__file__).parent / "web"  # the dashboard: static files, no build step (package data)

# ---- errors: one shape, field paths first -----------------------------------------------------


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "header", "path", "mlp", "cnn", "resnet",
                                                  "transformer")]
    return ".".join(parts)


def error_body(errors: list[dict[str, str]]) -> dict[str, Any]:
    """``{"detail": "field: message; ...", "errors": [{"field", "message"}]}``: one line a CLI can print."""
    detail = "; ".join(f"{e['field']}: {e['message']}" if e.get("field") else e["message"] for e in errors)
    return {"detail": detail, "errors": errors}


async def on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [{"field": _loc(e.get("loc", ())), "message": str(e.get("msg", "")).removeprefix("Value error, ")}
              for e in exc.errors()]
    return JSONResponse(error_body(errors), status_code=422)


async def on_service_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body([{"field": exc.field or "", "message": exc.message}]), status_code=exc.status,
                        headers=headers)


# ---- app state and dependencies ----------------------------------------------------------------


class State:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store.from_url(settings.redis_url)
        # a blocking pool: a burst of followers waits for a connection instead of failing with "Too many
        # connections"; live events need only one per followed job (the Hub), history reads are short
        self.aredis = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=64, timeout=30, decode_responses=True))
        self.hub = Hub(self.aredis, block_ms=int(min(5.0, settings.heartbeat_s) * 1000))
        self.registry = CollectorRegistry()
        self.requests = Counter("tlab_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("tlab_http_request_seconds", "HTTP request latency", ["route"],
                                 registry=self.registry,
                                 buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.submissions = Counter("tlab_submissions", "experiments accepted", registry=self.registry)
        self._jobs_client: Any = None
        self._users: dict[str, tuple[UserPublic, float]] = {}  # token -> (user, expiry): one lookup per 5 s
        self._cluster: tuple[tuple[ClusterView | None, float], float] = ((None, 0.0), 0.0)

    def authenticate(self, token: str) -> UserPublic:
        now = time.monotonic()
        hit = self._users.get(token)
        if hit and hit[1] > now:
            return hit[0]
        user = self.store.authenticate(token)
        if len(self._users) > 10_000:
            self._users.clear()
        self._users[token] = (user, now + USER_CACHE_S)
        return user

    def cluster_view(self) -> tuple[ClusterView | None, float]:
        """The scheduler's last published view (re-read at most every 0.5 s)."""
        now = time.monotonic()
        if now - self._cluster[1] > 0.5:
            self._cluster = (read_cluster_view(self), now)
        return self._cluster[0]

    def ray_jobs(self) -> Any:
        if self._jobs_client is None:
            from service.ray_cluster import RayJobs

            self._jobs_client = RayJobs(self.settings.ray_address, {})
        return self._jobs_client


def get_state(request: Request) -> State:
    return request.app.state.tlab


StateDep = Annotated[State, Depends(get_state)]
bearer = HTTPBearer(auto_error=False, description="a Teleport Lab token (`tlab up` writes the admin's)")


def current_user(st: StateDep, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> UserPublic:
    return st.authenticate(creds.credentials if creds else "")


CurrentUser = Annotated[UserPublic, Depends(current_user)]


def stream_user(st: StateDep, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
                token: Annotated[str | None, Query(max_length=200, description=(
                    "the token, for EventSource clients that cannot send headers; the Authorization header "
                    "wins"))] = None) -> UserPublic:
    """The bearer token, or ``?token=`` on the SSE routes (a browser's EventSource sends no headers)."""
    return st.authenticate(creds.credentials if creds else token or "")


StreamUser = Annotated[UserPublic, Depends(stream_user)]


def admin_user(user: CurrentUser) -> UserPublic:
    if user.role != Role.ADMIN:
        raise Forbidden("only an admin may do this", field="Authorization")
    return user


AdminUser = Annotated[UserPublic, Depends(admin_user)]


def own_job(st: State, user: UserPublic, job_id: str) -> dict[str, str]:
    data = st.store.raw(job_id)
    if user.role != Role.ADMIN and data["owner"] != user.name:
        raise Forbidden(f"experiment {job_id} belongs to another user", field="id")
    return data


# ---- the cluster as the scheduler last saw it ----------------------------------------------


def read_cluster_view(st: State) -> tuple[ClusterView | None, float]:
    raw = st.store.r.get(keys.cluster())
    if not raw:
        return None, 0.0
    data = json.loads(raw)
    view = ClusterView.model_validate(data["view"])
    age = time.time() - float(data["at"])
    view.scheduler_alive = age < max(10.0, 5 * st.settings.tick_s)
    return view, age


def known_nodes(st: State, view: ClusterView | None) -> list[policy.Node] | None:
    if st.settings.cluster_nodes:
        return StaticCluster(st.settings.cluster_nodes).nodes()
    if view is None:
        return None
    return [policy.Node(n.id, n.cpus_total, n.gpus_total) for n in view.nodes]


# ---- the app --------------------------------------------------------------------------------------


class Measure:
    """Pure ASGI middleware: request count and latency (to the response start) per route template."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                st: State | None = getattr(scope["app"].state, "tlab", None)
                if st is not None:
                    path = getattr(scope.get("route"), "path", "unmatched")
                    st.requests.labels(scope["method"], path, str(status[0])).inc()
                    st.latency.labels(path).observe(time.perf_counter() - t0)
            await send(message)

        await self.app(scope, receive, send_wrapper)



def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.tlab = State(settings)
        try:
            yield
        finally:
            await app.state.tlab.hub.close()
            await app.state.tlab.aredis.aclose()
            app.state.tlab.store.r.close()

    app = FastAPI(title="Teleport Lab", version="0.1.0", lifespan=lifespan,
                  description="Submit teleportation experiments to a shared Ray cluster; follow their curves.")
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ServiceError, on_service_error)

    app.add_middleware(Measure)
    add_routes(app)
    add_dashboard(app)
    return app


def add_dashboard(app: FastAPI) -> None:
    """The web dashboard: ``/`` is its page, ``/static/`` its scripts, styles and vendored chart library."""

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")


def add_routes(app: FastAPI) -> None:  # noqa: C901 - the route table reads best in one place
    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, bool]:
        """Alive (the process answers)."""
        return {"ok": True}

    @app.get("/readyz", tags=["health"], responses={503: {"description": "Redis or the scheduler is down"}})
    def readyz(st: StateDep) -> JSONResponse:
        """Ready: Redis answers and a scheduler has published within the last few ticks."""
        try:
            st.store.r.ping()
        except Exception as err:
            return JSONResponse({"ready": False, "reason": f"redis: {err}"}, status_code=503)
        view, _age = read_cluster_view(st)
        if view is None or not view.scheduler_alive:
            return JSONResponse({"ready": False, "reason": "no scheduler has reported recently"}, status_code=503)
        return JSONResponse({"ready": True})

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    def metrics(st: StateDep) -> Response:
        """Prometheus metrics: requests, latency, submissions, queue length, active jobs."""
        r = st.store.r
        extra = (f"# TYPE tlab_queue_length gauge\ntlab_queue_length {r.zcard(keys.queue())}\n"
                 f"# TYPE tlab_active_jobs gauge\ntlab_active_jobs {r.scard(keys.active())}\n")
        return Response(generate_latest(st.registry) + extra.encode(), media_type=CONTENT_TYPE_LATEST)

    # ---- experiments -----------------------------------------------------------------------
    @app.post("/v1/experiments", status_code=201, tags=["experiments"], response_model=JobView | DryRun,
              responses={200: {"description": "an Idempotency-Key replay: the original job"},
                         409: {"description": "Idempotency-Key reused with another body"},
                         422: {"description": "invalid spec, or a gang that can never fit"}})
    def submit(body: ExperimentSubmit, st: StateDep, user: CurrentUser, response: Response,
               dry_run: bool = False,
               idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> JobView | DryRun:
        """Queue an experiment (or, with ``dry_run=true``, say whether and where it would fit)."""
        demand = demand_of(body)
        view, _ = st.cluster_view()
        nodes = known_nodes(st, view)
        why = policy.never_fits(demand, nodes) if nodes else None
        if dry_run:
            free = ({n.id: [n.cpus_free, n.gpus_free] for n in view.nodes} if view else
                    {n.id: [n.cpus, n.gpus] for n in nodes or []})
            placement = policy.place(demand, free) if nodes else None
            response.status_code = 200
            return DryRun(demand=demand, fits_ever=why is None, fits_now=placement is not None,
                          placement=placement or [],
                          reason=why or (None if placement else "no room now: it would wait in the queue" if nodes
                                         else "the cluster is not known yet: no scheduler has reported"))
        if why:
            raise DoesNotFit(f"this experiment can never fit the cluster: {why}", field="spec.resources")
        return queue_job(st, user, body, response, idempotency_key)

    def queue_job(st: State, user: UserPublic, body: ExperimentSubmit | SweepSubmit, response: Response,
                  idempotency_key: str | None) -> JobView:
        """Queue it; an Idempotency-Key replay answers 200 with the original job."""
        job_id, created, qlen, now = st.store.submit(user.name, body, idempotency_key)
        if not created:
            response.status_code = 200
            response.headers["Idempotent-Replayed"] = "true"
            return st.store.view(job_id, with_progress=False)
        st.submissions.inc()
        spec = body.spec if isinstance(body, ExperimentSubmit) else body.base
        return JobView(id=job_id, kind="experiment" if isinstance(body, ExperimentSubmit) else "sweep",
                       name=body.name or job_id, owner=user.name, state=JobState.QUEUED, priority=body.priority,
                       tags=body.tags, spec=spec, demand=demand_of(body), created_at=now, queue_position=qlen,
                       pending_reason="waiting for the scheduler's next decision")

    def list_jobs(st: State, user: UserPublic, kind: str, state: JobState | None, owner: str | None,
                  tag: str | None, cursor: str | None, limit: int) -> JobList:
        if user.role != Role.ADMIN:
            if owner not in (None, user.name):
                raise Forbidden("you can list only your own jobs", field="owner")
            owner = user.name
        items: list[JobView] = []
        while True:
            ids, more = st.store.list_ids(owner, cursor, limit)
            for data in st.store.raws(ids):
                if (data.get("kind", "experiment") != kind or (state and data["state"] != state.value)
                        or (tag and tag not in json.loads(data.get("tags", "[]")))):
                    continue
                items.append(st.store.view(data["id"], data, with_progress=False))
                if len(items) == limit:
                    return JobList(items=items, next_cursor=data["id"] if (more or data["id"] != ids[-1]) else None)
            if not more:
                return JobList(items=items, next_cursor=None)
            cursor = ids[-1]

    @app.get("/v1/experiments", tags=["experiments"])
    def list_experiments(st: StateDep, user: CurrentUser,
                         state: JobState | None = None, owner: str | None = None, tag: str | None = None,
                         cursor: Annotated[str | None, Query(max_length=64)] = None,
                         limit: Annotated[int, Query(ge=1, le=500)] = 50) -> JobList:
        """Your experiments, newest first (admins: everyone's, or ``owner=``); filter by state and tag."""
        return list_jobs(st, user, "experiment", state, owner, tag, cursor, limit)

    @app.get("/v1/experiments/{job_id}", tags=["experiments"])
    def get_experiment(job_id: str, st: StateDep, user: CurrentUser) -> JobView:
        """One experiment: state, why it is pending, progress, summary or failure reason."""
        return st.store.view(job_id, own_job(st, user, job_id))

    @app.delete("/v1/experiments/{job_id}", status_code=202, tags=["experiments"],
                responses={409: {"description": "already ended"}})
    def cancel(job_id: str, st: StateDep, user: CurrentUser) -> JobView:
        """Cancel: a queued job leaves the queue; a running one is stopped (SIGTERM, then SIGKILL after the grace)."""
        own_job(st, user, job_id)
        st.store.cancel(job_id)
        return st.store.view(job_id)

    @app.get("/v1/experiments/{job_id}/events", tags=["experiments"],
             responses={200: {"content": {"text/event-stream": {}}, "description": "SSE: metric, teleport, "
                                                                                    "status, log, end"}})
    async def events(job_id: str, st: StateDep, user: StreamUser,
                     last_event_id: Annotated[str | None, Header(max_length=64)] = None) -> StreamingResponse:
        """Server-Sent Events: history, then live; ``Last-Event-ID`` resumes after that stream id."""
        await run_in_threadpool(own_job, st, user, job_id)
        if last_event_id is not None and not valid_stream_id(last_event_id):
            raise InvalidInput("Last-Event-ID must be a stream id like 1712345678901-0", field="Last-Event-ID")
        return StreamingResponse(follow(st.hub, job_id, last_event_id, st.settings.heartbeat_s),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          "Connection": "keep-alive"})

    def job_records(st: State, job_id: str) -> list[dict[str, Any]]:
        return records(st.store.events(job_id))

    @app.get("/v1/experiments/{job_id}/metrics", tags=["experiments"],
             responses={200: {"content": {"text/csv": {}}}})
    def get_metrics(job_id: str, st: StateDep, user: CurrentUser,
                    max_points: Annotated[int | None, Query(ge=1, le=100_000)] = None,
                    format: Literal["json", "csv"] = "json") -> Any:
        """Per-epoch metrics (downsampled to ``max_points``), and the teleport reports; ``format=csv`` for a table."""
        own_job(st, user, job_id)
        recs = job_records(st, job_id)
        rows = [r for r in recs if r.get("kind") == "epoch"]
        points = downsample(rows, max_points)
        if format == "csv":
            columns = list(dict.fromkeys(k for r in points for k in r if k != "kind"))
            out = io.StringIO()
            writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(points)
            return Response(out.getvalue(), media_type="text/csv")
        return MetricsView(id=job_id, total_points=len(rows), points=points,
                           teleports=[r for r in recs if r.get("kind") == "teleport"])

    @app.get("/v1/experiments/{job_id}/plot.png", tags=["experiments"],
             responses={200: {"content": {"image/png": {}}}})
    def plot(job_id: str, st: StateDep, user: CurrentUser,
             compare: Annotated[str | None, Query(max_length=2000, description="more ids, comma-separated")] = None,
             ) -> Response:
        """Train/test loss (teleport epochs marked); ``compare=id2,id3`` overlays other experiments."""
        from plots.curves import plot_curves

        ids = [job_id] + [i for i in (compare or "").split(",") if i.strip()]
        runs = {}
        for i in (i.strip() for i in ids):
            name = own_job(st, user, i).get("name") or i
            runs[name if name not in runs else f"{name} ({i})"] = job_records(st, i)
        buf = io.BytesIO()
        plot_curves(runs, buf, title=None, fmt="png")
        return Response(buf.getvalue(), media_type="image/png")

    @app.get("/v1/experiments/{job_id}/logs", tags=["experiments"], response_class=PlainTextResponse)
    def logs(job_id: str, st: StateDep, user: CurrentUser) -> str:
        """The Ray job's driver log while Ray still has it, then the job's own log events."""
        data = own_job(st, user, job_id)
        lines = []
        sid = data.get("ray_job_id")
        if sid:
            try:
                text = st.ray_jobs().logs(sid)
            except Exception:
                text = None
            if text:
                lines.append(text.rstrip("\n"))
        for rec in job_records(st, job_id):
            if rec.get("kind") in ("log", "status"):
                lines.append(json.dumps(rec))
        return "\n".join(lines) + "\n"

    # ---- sweeps ----------------------------------------------------------------------------------
    def own_sweep(st: State, user: UserPublic, sweep_id: str) -> dict[str, str]:
        data = own_job(st, user, sweep_id)
        if data.get("kind") != "sweep":
            raise JobNotFound(f"{sweep_id} is an experiment, not a sweep: see /v1/experiments/{sweep_id}", field="id")
        return data

    def trial_rows(st: State, sweep_id: str) -> list[TrialRow]:
        rows = [TrialRow.model_validate_json(v) for v in st.store.r.hgetall(keys.trials(sweep_id)).values()]
        return sorted(rows, key=lambda t: t.trial)

    @app.post("/v1/sweeps", status_code=201, tags=["sweeps"],
              responses={200: {"description": "an Idempotency-Key replay"}, 409: {"description": "key reused"},
                         422: {"description": "a bad search space (the path is named), or a gang that never fits"}})
    def submit_sweep(body: SweepSubmit, st: StateDep, user: CurrentUser, response: Response,
                     idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> JobView:
        """Queue a hyperparameter sweep: one job whose gang is ``max_concurrent_trials`` trials' workers."""
        demand = demand_of(body)
        view, _ = st.cluster_view()
        nodes = known_nodes(st, view)
        why = policy.never_fits(demand, nodes) if nodes else None
        if why:
            raise DoesNotFit(f"max_concurrent_trials={body.max_concurrent_trials} trials at once can never fit the "
                             f"cluster: {why} (or lower max_concurrent_trials)", field="max_concurrent_trials")
        return queue_job(st, user, body, response, idempotency_key)

    @app.get("/v1/sweeps", tags=["sweeps"])
    def list_sweeps(st: StateDep, user: CurrentUser, state: JobState | None = None, owner: str | None = None,
                    tag: str | None = None, cursor: Annotated[str | None, Query(max_length=64)] = None,
                    limit: Annotated[int, Query(ge=1, le=500)] = 50) -> JobList:
        """Your sweeps, newest first."""
        return list_jobs(st, user, "sweep", state, owner, tag, cursor, limit)

    @app.get("/v1/sweeps/{sweep_id}", tags=["sweeps"])
    def get_sweep(sweep_id: str, st: StateDep, user: CurrentUser) -> SweepView:
        """The sweep's state, its trials table (config, state, last/best metric, epochs, stopped early), the best."""
        data = own_sweep(st, user, sweep_id)
        sweep = SweepSubmit.model_validate_json(data["sweep"])
        rows = trial_rows(st, sweep_id)
        scored = [t for t in rows if t.best is not None]
        best = (min(scored, key=lambda t: t.best if sweep.mode == "min" else -t.best)  # type: ignore[operator]
                if scored else None)
        return SweepView(job=st.store.view(sweep_id, data), metric=sweep.metric, mode=sweep.mode, trials=rows,
                         best=best)

    @app.delete("/v1/sweeps/{sweep_id}", status_code=202, tags=["sweeps"],
                responses={409: {"description": "already ended"}})
    def cancel_sweep(sweep_id: str, st: StateDep, user: CurrentUser) -> JobView:
        """Cancel a sweep: its Ray job (the Tune driver, and with it every trial) is stopped."""
        own_sweep(st, user, sweep_id)
        st.store.cancel(sweep_id)
        return st.store.view(sweep_id)

    @app.get("/v1/sweeps/{sweep_id}/events", tags=["sweeps"],
             responses={200: {"content": {"text/event-stream": {}}, "description": "every trial's events "
                                                                                    "(data.trial), then end"}})
    async def sweep_events(sweep_id: str, st: StateDep, user: StreamUser,
                           last_event_id: Annotated[str | None, Header(max_length=64)] = None) -> StreamingResponse:
        """SSE of every trial's events, tagged with the trial id; resumable with ``Last-Event-ID``."""
        await run_in_threadpool(own_sweep, st, user, sweep_id)
        return await events(sweep_id, st, user, last_event_id)

    def seed_groups(sweep: SweepSubmit, rows: list[TrialRow]) -> dict[str, list[TrialRow]]:
        """Trials grouped by their non-seed parameters (each trial alone when the space has no seed)."""
        groups: dict[str, list[TrialRow]] = {}
        for t in rows:
            if "training.seed" not in sweep.search_space:
                groups[t.trial] = [t]
                continue
            rest = {k: v for k, v in t.config.items() if k != "training.seed"}
            label = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in sorted(rest.items())) or "all"
            groups.setdefault(label, []).append(t)
        return groups

    @app.get("/v1/sweeps/{sweep_id}/plot.png", tags=["sweeps"], responses={200: {"content": {"image/png": {}}}})
    def sweep_plot(sweep_id: str, st: StateDep, user: CurrentUser) -> Response:
        """Every trial's curves; with ``training.seed`` in the space, mean ± std bands per setting of the rest."""
        from plots.curves import plot_bands, plot_curves

        data = own_sweep(st, user, sweep_id)
        sweep = SweepSubmit.model_validate_json(data["sweep"])
        by_trial: dict[str, list[dict[str, Any]]] = {}
        for rec in job_records(st, sweep_id):
            if rec.get("trial"):
                by_trial.setdefault(rec["trial"], []).append(rec)
        rows = [t for t in trial_rows(st, sweep_id) if t.trial in by_trial]
        buf = io.BytesIO()
        if "training.seed" in sweep.search_space:
            bands = {label: [by_trial[t.trial] for t in ts] for label, ts in seed_groups(sweep, rows).items()}
            plot_bands(bands, buf, title=f"sweep {sweep_id}: mean ± std over training.seed", fmt="png")
        else:
            plot_curves({t.trial: by_trial[t.trial] for t in rows}, buf, title=f"sweep {sweep_id}", fmt="png")
        return Response(buf.getvalue(), media_type="image/png")

    @app.get("/v1/sweeps/{sweep_id}/study", tags=["sweeps"])
    def sweep_study(sweep_id: str, st: StateDep, user: CurrentUser) -> StudyView:
        """The paper-style table: per setting of the non-seed parameters, mean ± std over seeds of the final
        train/test loss and accuracy, epochs and seconds to ``training.target_loss``, teleport's share of time."""
        from plots.tables import compare_table, group_stats

        data = own_sweep(st, user, sweep_id)
        sweep = SweepSubmit.model_validate_json(data["sweep"])
        groups = seed_groups(sweep, trial_rows(st, sweep_id))
        seeds = max((len(ts) for ts in groups.values()), default=0)
        target = sweep.base.training.target_loss
        runs = {label: [t.summary for t in ts] for label, ts in groups.items()}
        return StudyView(
            id=sweep_id, seeds=seeds, target_loss=target,
            groups=[StudyGroup(label=label, config={k: v for k, v in ts[0].config.items() if k != "training.seed"},
                               trials=[t.trial for t in ts], stats=group_stats(runs[label]), runs=runs[label])
                    for label, ts in groups.items()],
            table=compare_table(runs, seeds, target) if groups else "(no trial has reported yet)")

    # ---- queue, cluster, presets -----------------------------------------------------------------
    @app.get("/v1/queue", tags=["cluster"])
    def queue(st: StateDep, user: CurrentUser) -> QueueView:
        """Queued experiments in the order they will start, with why each one waits."""
        ids = st.store.r.zrange(keys.queue(), 0, -1)
        order = {k: json.loads(v) for k, v in st.store.r.hgetall(keys.queue_view()).items()}
        entries = []
        for data in st.store.raws(ids):
            q = order.get(data["id"], {})
            job = st.store.view(data["id"], data, with_progress=False)
            entries.append(QueueEntry(position=q.get("position", len(ids)), id=job.id, owner=job.owner,
                                      name=job.name, priority=job.priority, demand=job.demand,
                                      created_at=job.created_at,
                                      pending_reason=q.get("reason", "waiting for the scheduler's next decision")))
        entries.sort(key=lambda e: (e.position, e.created_at))
        return QueueView(items=entries)

    @app.get("/v1/cluster", tags=["cluster"], responses={503: {"description": "no scheduler has reported"}})
    def cluster(st: StateDep, user: CurrentUser) -> ClusterView:
        """Nodes with total and free CPUs/GPUs, and the running experiments, as the scheduler last saw them."""
        view, _ = st.cluster_view()
        if view is None:
            return ClusterView(nodes=[], cpus_total=0, cpus_free=0, gpus_total=0, gpus_free=0, running_jobs=[],
                               scheduler_alive=False)
        return view

    @app.get("/v1/presets", tags=["experiments"])
    def presets(user: CurrentUser) -> dict[str, dict[str, Any]]:
        """Ready-made specs (paper table rows, fast digits demos): ``{name: {note, spec}}``."""
        return {name: {"note": PRESET_NOTES.get(name, ""), "spec": spec} for name, spec in PRESETS.items()}

    # ---- users ---------------------------------------------------------------------------------
    @app.post("/v1/users", status_code=201, tags=["users"], responses={409: {"description": "name taken"}})
    def create_user(body: UserCreate, st: StateDep, admin: AdminUser) -> UserCreated:
        """Create a user with quotas (admin only); the token is in this response and nowhere else."""
        user, token = st.store.create_user(body)
        return UserCreated(user=user, token=token)

    @app.get("/v1/users", tags=["users"])
    def list_users(st: StateDep, admin: AdminUser) -> list[UserPublic]:
        """Every user and their quotas (admin only)."""
        return st.store.users()

    @app.get("/v1/me", tags=["users"])
    def me(user: CurrentUser) -> UserPublic:
        """Who this token belongs to."""
        return user


def main() -> int:
    import uvicorn

    settings = Settings()
    uvicorn.run(create_app(settings), host=settings.bind, port=settings.port, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
