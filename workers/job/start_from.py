"""Which checkpoint a continued or forked job starts from (``service.api.lineage`` wrote it): read by the job's trusted
processes without torch, so the sandbox is started before torch is imported anywhere and the payload is told the path
(and may read only that checkpoint of another run: ``workers.job.sandbox``).

The job's driver decides it once, before any payload of its Ray job runs, from the scheduler's copy of the service's
record (the job hash's ``start_from``, which the job cannot write: ``service.launch.job_acl``), and hands it to each
rank of a gang as a task argument (``workers.on_ray.gang_start.Ranks``): the job may rewrite its own copy while it
runs, so nothing reads it again. The path is taken through ``api_schemas.gate``: ``<storage>/<job id>/checkpoint_*``,
a real directory with no link below the storage root, holding a regular ``checkpoint.pt``.
"""

from __future__ import annotations

import re
from pathlib import Path

import redis

from api_schemas import gate
from api_schemas.lineage import StartFrom
from workers.job.artifacts import CHECKPOINT_FILE, checkpoints
from workers.job.bucket import pull_dir
from workers.job.record import job_field

CHECKPOINT_NAME = r"checkpoint_[\w.-]+"  # a checkpoint directory's name (``StartFrom.checkpoint``)


def start_checkpoint(client: redis.Redis, job_id: str, storage: str | Path) -> Path | None:
    """The checkpoint directory a continued or forked job starts from (its record's ``start_from``, written by
    ``service.api.lineage``), while its run has no checkpoint of its own (a requeued child goes on from its own);
    None for a job that starts from scratch. See ``resolve_start``."""
    raw = job_field(client, job_id, "start_from")
    if not raw:
        return None
    try:
        start = StartFrom.model_validate_json(raw)
    except ValueError:
        raise gate.Refused("the job's start_from refused: not a checkpoint as the service records one") from None
    return resolve_start(storage, job_id, start.path(storage), f"experiment {start.job} after epoch {start.epoch}")


def resolve_start(storage: str | Path, job_id: str, named: str | Path | None, what: str = "") -> Path | None:
    """``named`` (the driver's decision; a rank's task argument) checked on this node: None when there is none or
    the job's run has checkpoints of its own; else ``<storage>/<job id>/checkpoint_*``, a real directory reached with
    no link below the storage root, holding a regular ``checkpoint.pt`` (pulled from a bucket first when this node
    has none). ``gate.Refused`` for any other path; a ValueError naming it when it is gone."""
    if named is None or checkpoints([Path(storage) / job_id]):
        return None
    parts = gate.named_under(storage, named)
    if len(parts) != 2 or not re.fullmatch(CHECKPOINT_NAME, parts[1]):
        raise gate.Refused(f"the checkpoint to start from, {str(named)[:200]!r}, refused: not a checkpoint "
                           "directory of a run in storage")
    parent, name = gate.job_id(parts[0]), parts[1]
    if not present(storage, parent, name):  # a bucket's copy, when storage is one and this node has none
        pull_dir(storage, f"{parent}/{name}")
    if not present(storage, parent, name):
        raise ValueError(f"the checkpoint to start from ({what or f'experiment {parent}'}, {Path(storage, *parts)}) "
                         "is gone: submit the spec as a new experiment instead")
    return gate.real_dir(storage, parent, name)


def present(storage: str | Path, parent: str, name: str) -> bool:
    """Whether the run ``parent`` has the checkpoint directory ``name`` with its file (a link there: ``Refused``)."""
    try:
        gate.real_dir(storage, parent, name)
    except FileNotFoundError:
        return False
    return gate.regular_file(storage, parent, name, CHECKPOINT_FILE)
