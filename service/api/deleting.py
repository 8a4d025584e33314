"""Deleting an ended job: its record and every key of it in Redis, then its files (checkpoints, artifacts, logs;
a sweep's Tune directory too), here and in the bucket. From then on its id answers 404.

A job that has not ended is refused (409: cancel it first, ``POST .../cancel``); so is the parent of an
experiment that has not ended, which may still start from the parent's checkpoint (``service.api.lineage``).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from api_schemas import keys
from api_schemas.jobs import TERMINAL
from api_schemas.redis_scripts import DELETE_ENDED
from service.core import storage
from service.core.errors import InvalidState
from service.core.settings import Settings
from service.core.storage_lifecycle import forget
from service.core.store import Store

log = logging.getLogger("tlab.api")


def unended_children(store: Store, data: dict[str, str]) -> list[str]:
    """The job's continued or forked experiments that have not ended (they may still need its checkpoint)."""
    children = json.loads(data.get("children") or "[]")
    states = [store.r.hget(keys.job(c), "state") for c in children]
    return [c for c, s in zip(children, states, strict=True) if s and s not in {t.value for t in TERMINAL}]


def delete_job(store: Store, settings: Settings, data: dict[str, str], route: str) -> None:
    """Delete the ended job ``data`` (its raw hash): Redis in one step, then its files. ``route``: experiments or
    sweeps, for the error's hint."""
    job_id, noun = data["id"], route.removesuffix("s")
    waiting = unended_children(store, data)
    if waiting:
        raise InvalidState(f"experiment {waiting[0]}, continued or forked from {job_id}, has not ended and may still "
                           f"start from its checkpoint: delete {job_id} once it has", field="id")
    owner = data.get("owner", "")
    done = store.r.register_script(DELETE_ENDED)(
        keys=[keys.job(job_id), keys.jobs(), keys.user_jobs(owner), keys.queue_view(), *keys.job_keys(job_id)],
        args=[job_id, ",".join(sorted(t.value for t in TERMINAL))])
    if done != 1:
        raise InvalidState(f"{noun} {job_id} is {done}: cancel it first (POST /v1/{route}/{job_id}/cancel, `tlab "
                           f"cancel {job_id}`), then delete it once it has ended", field="id")
    forget(store, data)  # its bytes off its owner's max_storage_gb count
    remove_files(settings, job_id)


def remove_files(settings: Settings, job_id: str) -> None:
    """The job's directories under the storage root (and in the bucket): never following a link out of it."""
    root = Path(settings.storage_path)
    for name in (job_id, f"sweep-{job_id}"):
        path = root / name
        try:
            if path.is_symlink():
                path.unlink()  # a link the job made in the root: the link goes, never what it points at
            elif path.is_dir():
                shutil.rmtree(path)  # unlinks links inside, never descends into them
        except OSError as err:
            log.warning("deleting %s: could not remove %s: %s", job_id, path, err)
        storage.delete(settings, name)
