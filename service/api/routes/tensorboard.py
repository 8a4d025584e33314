"""TensorBoard: a job's event files (the scheduler writes them from its per-epoch records) as one tar.gz."""

from __future__ import annotations

import io
import tarfile

from fastapi import APIRouter, Response

from service.api.deps import CurrentUser, StateDep, own_job, own_sweep
from service.api.responses import AUTHED, OWNED

router = APIRouter(tags=["tensorboard"], responses=AUTHED)
TAR_GZ = {200: {"content": {"application/gzip": {}},
                "description": "a tar.gz of the job's TensorBoard run directory (<id>/...); empty until its first "
                               "epoch was written"}}


def tar_of(st: StateDep, job_id: str) -> Response:
    """The job's directory under ``<id>/`` in a tar.gz: files only, written by the scheduler (no job writes there)."""
    from service.core import tensorboard_files  # the protobufs TensorBoard writes with: only when asked

    folder = tensorboard_files.directory(st.settings, job_id)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
            if path.is_file() and not path.is_symlink() and not path.name.startswith("."):
                tar.add(path, arcname=f"{job_id}/{path.relative_to(folder).as_posix()}", recursive=False)
    return Response(buf.getvalue(), media_type="application/gzip",
                    headers={"Content-Disposition": f'attachment; filename="{job_id}-tensorboard.tar.gz"'})


@router.get("/v1/experiments/{job_id}/tensorboard", response_class=Response, responses=TAR_GZ | OWNED)
def experiment_tensorboard(job_id: str, st: StateDep, user: CurrentUser) -> Response:
    """The experiment's TensorBoard event files (every epoch once: losses, accuracy, lr, teleports) as a tar.gz."""
    own_job(st, user, job_id)
    return tar_of(st, job_id)


@router.get("/v1/sweeps/{sweep_id}/tensorboard", response_class=Response, responses=TAR_GZ | OWNED)
def sweep_tensorboard(sweep_id: str, st: StateDep, user: CurrentUser) -> Response:
    """The sweep's TensorBoard files: a run directory per trial and the HParams view of their configs."""
    own_sweep(st, user, sweep_id)
    return tar_of(st, sweep_id)
