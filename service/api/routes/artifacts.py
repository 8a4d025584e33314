"""Artifacts: list a job's files (name, bytes, sha256) and download one (Range requests supported).
A sweep's are its best trial's."""

from __future__ import annotations

import os
from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from api_schemas.artifacts import ArtifactList
from service.api import artifacts
from service.api.deps import CurrentUser, StateDep, own_job, own_sweep
from service.api.responses import AUTHED, OWNED, error

router = APIRouter(tags=["artifacts"], responses=AUTHED)
FILE_RESPONSES: dict[int | str, dict] = OWNED | {
    200: {"content": {"application/octet-stream": {}}, "description": "the file"},
    206: {"description": "the bytes a Range header asked for (Content-Range says which)"},
    # Starlette's FileResponse answers a Range it cannot serve itself, in plain text
    400: {"description": "a malformed Range header", "content": {"text/plain": {"schema": {"type": "string"}}}},
    404: error("no such job or artifact (or a name that leads outside the job's directory)"),
    416: {"description": "the Range is outside the file (Content-Range says its size)",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
    422: error("an absolute name, or one with '..'"),
}


# A relative name of segments that are never '..', without backslashes or NUL (what artifacts.check_name refuses),
# said in the schema itself so that a request the schema allows is one the route can answer.
_SEGMENT = r"(?:[^/.\\\x00][^/\\\x00]*|\.(?:[^/.\\\x00][^/\\\x00]*)?|\.\.[^/\\\x00]+)"
Name = Annotated[str, PathParam(pattern=f"^{_SEGMENT}(?:/{_SEGMENT})*$", max_length=1000,
                                description="a name from the artifact list (relative, no '..', no backslash)")]


def download(st: StateDep, job_id: str, name: str) -> FileResponse:
    """Served from the descriptor ``open_artifact`` checked (no link followed), closed once the response is sent."""
    fd = artifacts.open_artifact(st.settings, job_id, name)
    return FileResponse(f"/proc/self/fd/{fd}", filename=name.rsplit("/", 1)[-1],
                        media_type="application/octet-stream", background=BackgroundTask(os.close, fd))


@router.get("/v1/experiments/{job_id}/artifacts", responses=OWNED)
def list_artifacts(job_id: str, st: StateDep, user: CurrentUser) -> ArtifactList:
    """The experiment's artifacts: model.safetensors, checkpoint.pt, metrics.csv, summary.json, its own files."""
    own_job(st, user, job_id)
    return ArtifactList(id=job_id, items=artifacts.listing(st.settings, job_id))


@router.get("/v1/experiments/{job_id}/artifacts/{name:path}", response_class=FileResponse, responses=FILE_RESPONSES)
def get_artifact(job_id: str, name: Name, st: StateDep, user: CurrentUser) -> FileResponse:
    """One artifact's bytes (owner or admin); ``Range: bytes=a-b`` for a part."""
    own_job(st, user, job_id)
    return download(st, job_id, name)


@router.get("/v1/sweeps/{sweep_id}/artifacts", responses=OWNED)
def list_sweep_artifacts(sweep_id: str, st: StateDep, user: CurrentUser) -> ArtifactList:
    """The sweep's best trial's artifacts (its weights first of all; summary.json names the trial)."""
    own_sweep(st, user, sweep_id)
    return ArtifactList(id=sweep_id, items=artifacts.listing(st.settings, sweep_id))


@router.get("/v1/sweeps/{sweep_id}/artifacts/{name:path}", response_class=FileResponse, responses=FILE_RESPONSES)
def get_sweep_artifact(sweep_id: str, name: Name, st: StateDep, user: CurrentUser) -> FileResponse:
    """One of the best trial's artifacts."""
    own_sweep(st, user, sweep_id)
    return download(st, sweep_id, name)
