"""Deleting an ended job, by its owner (``DELETE``) or once its history has expired (``TLAB_HISTORY_DAYS``).

Deleting removes the job's hash and every key of it in Redis in one step (a job that has not ended is left as it is,
and its state said), takes its bytes off its owner's ``max_storage_gb`` count, then removes its files (checkpoints,
artifacts, logs; a sweep's Tune directory too), here and in the bucket — never following a link out of the
storage root.

Expiry: with ``TLAB_HISTORY_DAYS`` set, the scheduler deletes each ended job whose end is older than that, as a
``DELETE`` would (``expire``), so Redis and the disk stay bounded on a service that runs for months. A job whose
continued or forked child has not ended stays (the child may still start from its checkpoint). Job ids sort by
creation time, and a job cannot have ended before it was created, so the scan stops at the first job created
inside the window: each pass reads only the candidates, ``EXPIRE_BATCH`` at a time.
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
from service.core.settings import Settings
from service.core.storage_lifecycle import forget
from service.core.store import Store

log = logging.getLogger("tlab.retention")
ENDED = ",".join(sorted(t.value for t in TERMINAL))
EXPIRE_BATCH = 200  # job hashes read per Redis round trip while looking for expired ones
EXPIRE_EVERY_S = 600.0  # how often the scheduler looks (the first tick looks at once)
DAY = 86400.0


def unended_children(store: Store, data: dict[str, str]) -> list[str]:
    """The job's continued or forked experiments that have not ended (they may still need its checkpoint)."""
    children = json.loads(data.get("children") or "[]")
    states = [store.r.hget(keys.job(c), "state") for c in children]
    return [c for c, s in zip(children, states, strict=True) if s and s not in {t.value for t in TERMINAL}]


def delete_ended(store: Store, settings: Settings, data: dict[str, str]) -> int | str:
    """Delete the job ``data`` (its raw hash) if it has ended: 1, or — nothing done — its state ("missing" when
    gone). The caller checks ``unended_children`` first."""
    job_id, owner = data["id"], data.get("owner", "")
    done = store.r.register_script(DELETE_ENDED)(
        keys=[keys.job(job_id), keys.jobs(), keys.user_jobs(owner), keys.queue_view(), *keys.job_keys(job_id)],
        args=[job_id, ENDED])
    if done == 1:
        forget(store, data)  # its bytes off its owner's max_storage_gb count
        remove_files(settings, job_id)
    return done


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


def expire(store: Store, settings: Settings, now: float) -> list[str]:
    """Delete every ended job that ended more than ``TLAB_HISTORY_DAYS`` ago (none when unset); their ids."""
    if settings.history_days is None:
        return []
    cutoff = now - settings.history_days * DAY
    deleted: list[str] = []
    after = "-"
    while True:
        ids = store.r.zrangebylex(keys.jobs(), after, "+", start=0, num=EXPIRE_BATCH)
        if not ids:
            return deleted
        for data in store.raws(ids):
            if float(data.get("created_at") or 0) >= cutoff:
                return deleted  # created inside the window: it and every later job ended inside it too
            if _expired(data, cutoff) and not unended_children(store, data):
                if delete_ended(store, settings, data) == 1:
                    deleted.append(data["id"])
                    log.info("deleted %s: it ended %.1f days ago (TLAB_HISTORY_DAYS=%g)", data["id"],
                             (now - float(data["finished_at"])) / DAY, settings.history_days)
        after = f"({ids[-1]}"


def _expired(data: dict[str, str], cutoff: float) -> bool:
    try:
        return data.get("state") in ENDED.split(",") and float(data.get("finished_at") or "inf") < cutoff
    except ValueError:
        return False
