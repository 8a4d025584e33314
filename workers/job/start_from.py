"""Which checkpoint a continued or forked job starts from (``service.api.lineage`` wrote it): read by the job's trusted
processes (its driver, each gang rank's task) without torch, so the sandbox is started before torch is imported anywhere
and the payload is told the path (and may read only that checkpoint of another run: ``workers.job.sandbox``)."""

from __future__ import annotations

from pathlib import Path

import redis

from api_schemas.lineage import StartFrom
from workers.job.artifacts import CHECKPOINT_FILE, checkpoints
from workers.job.bucket import pull_dir
from workers.job.record import job_field


def start_checkpoint(client: redis.Redis, job_id: str, storage: str | Path) -> Path | None:
    """The checkpoint directory a continued or forked job starts from (its hash's ``start_from``, written by
    ``service.api.lineage``), while its run has no checkpoint of its own (a requeued child goes on from its own);
    None for a job that starts from scratch. A ValueError naming it when it is gone."""
    raw = job_field(client, job_id, "start_from")
    if not raw or checkpoints([Path(storage) / job_id]):
        return None
    start = StartFrom.model_validate_json(raw)
    path = start.path(storage)
    if not (path / CHECKPOINT_FILE).is_file():  # a bucket's copy, when storage is one and this node has none
        pull_dir(storage, f"{start.job}/{start.checkpoint}")
    if not (path / CHECKPOINT_FILE).is_file():
        raise ValueError(f"the checkpoint to start from (experiment {start.job} after epoch {start.epoch}, {path}) "
                         "is gone: submit the spec as a new experiment instead")
    return path
