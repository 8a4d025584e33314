"""The REST API (FastAPI): the app factory; the routes live one resource per file in ``service/api/routes/``.

Run it with ``python -m service.api`` (``TLAB_BIND``/``TLAB_PORT``; 127.0.0.1:8470 by default) or
through ``tlab up``. Every route but ``/healthz``, ``/readyz``, ``/metrics`` and the dashboard's page (``/``,
``/static/``) needs a bearer token; the SSE routes also take it as ``?token=`` (for a browser's EventSource).
The scheduler process does the starting; the API only reads and writes the Redis store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from service.api.deps import State
from service.api.http_errors import add_error_handlers
from service.api.middleware import BodyLimit, Measure
from service.api.routes import (
    artifacts,
    cluster,
    code,
    experiments,
    health,
    logs,
    nodes,
    presets,
    sweeps,
    tensorboard,
    users,
)
from service.core.settings import Settings
from service.core.storage import check_or_exit

WEB_DIR = Path(__file__).parent / "web"  # the dashboard: static files, no build step (package data)
ROUTERS = (health, experiments, logs, sweeps, artifacts, tensorboard, code, cluster, nodes, presets, users)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.tlab = State(settings)
        try:
            yield
        finally:
            await app.state.tlab.aclose()

    app = FastAPI(title="Teleport Lab", version="0.1.0", lifespan=lifespan,
                  description="Submit teleportation experiments to a shared Ray cluster; follow their curves.")
    add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(Measure)
    for module in ROUTERS:
        app.include_router(module.router)
    add_dashboard(app)
    return app


def index() -> FileResponse:
    """The dashboard's page."""
    return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def add_dashboard(app: FastAPI) -> None:
    """The web dashboard: ``/`` is its page, ``/static/`` its scripts, styles and vendored chart library."""
    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")


def main() -> int:
    import uvicorn

    settings = Settings()
    check_or_exit(settings, reach=False)  # a malformed TLAB_STORAGE URI: one line, before serving
    uvicorn.run(create_app(settings), host=settings.bind, port=settings.port, log_level="warning",
                access_log=False)
    return 0

