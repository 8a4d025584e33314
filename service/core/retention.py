"""Deleting an ended job, by its owner (``DELETE``) or once its history has expired (``TLAB_HISTORY_DAYS``).

Deleting removes the job's hash and every key of it the service names in Redis in one step (a job that has not ended
is left as it is, and its state said), then any other key under ``tlab:job:<id>:`` (found with SCAN: a job's user of an
older release could make them), takes its bytes off its owner's ``max_storage_gb`` count, then removes its files
(checkpoints, artifacts, logs; a sweep's Tune directory too), here and in the bucket — never following a link out of
the storage root.

Code packages: with ``TLAB_CODE_TTL_DAYS`` set, a stored package (``service.core.code_store``) that no job refers
to — queued, running or ended, until it is deleted — is deleted that many days after its upload or last re-upload
(``expire_code``), with the scheduler's verified copy of it once no owner's package of those bytes is left.

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
import stat
from collections.abc import Iterator
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
        drop_leftovers(store, job_id)
        forget(store, data)  # its bytes off its owner's max_storage_gb count
        remove_files(settings, job_id)
    return done


def drop_leftovers(store: Store, job_id: str) -> int:
    """Delete every key left under the deleted job's hash (``SCAN MATCH tlab:job:<id>:*``): how many."""
    found = list(store.r.scan_iter(match=keys.job_key_pattern(job_id), count=1000))
    for at in range(0, len(found), 500):
        store.r.unlink(*found[at:at + 500])
    return len(found)


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
    # its TensorBoard files (service.core.tensorboard_files.directory: the scheduler's own, no job writes there)
    shutil.rmtree(Path(settings.home) / "tensorboard" / job_id, ignore_errors=True)


def expire(store: Store, settings: Settings, now: float) -> list[str]:
    """Delete every ended job that ended more than ``TLAB_HISTORY_DAYS`` ago (none when unset); their ids."""
    if settings.history_days is None:
        return []
    cutoff = now - settings.history_days * DAY
    deleted: list[str] = []
    for ids in job_pages(store):
        for data in store.raws(ids):
            if float(data.get("created_at") or 0) >= cutoff:
                return deleted  # created inside the window: it and every later job ended inside it too
            if _expired(data, cutoff) and not unended_children(store, data):
                if delete_ended(store, settings, data) == 1:
                    deleted.append(data["id"])
                    log.info("deleted %s: it ended %.1f days ago (TLAB_HISTORY_DAYS=%g)", data["id"],
                             (now - float(data["finished_at"])) / DAY, settings.history_days)
    return deleted


def job_pages(store: Store) -> Iterator[list[str]]:
    """Every job id Redis holds, oldest first (ids sort by creation time), ``EXPIRE_BATCH`` at a time."""
    after = "-"
    while ids := store.r.zrangebylex(keys.jobs(), after, "+", start=0, num=EXPIRE_BATCH):
        yield ids
        after = f"({ids[-1]}"


def _expired(data: dict[str, str], cutoff: float) -> bool:
    try:
        return data.get("state") in ENDED.split(",") and float(data.get("finished_at") or "inf") < cutoff
    except ValueError:
        return False


def expire_code(store: Store, settings: Settings, now: float) -> list[str]:
    """Delete the code packages uploaded more than ``TLAB_CODE_TTL_DAYS`` ago that no job refers to (none when
    unset); their paths relative to the storage root."""
    if settings.code_ttl_days is None:
        return []
    cutoff = now - settings.code_ttl_days * DAY
    root = Path(settings.storage_path)
    old = [p for p in sorted((root / "code").glob("*/*.zip")) if _older(p, cutoff)]
    if not old:
        return []
    used = referenced_packages(store)
    gone = []
    for path in old:
        if (path.parent.name, f"sha256:{path.stem}") not in used:
            storage.remove(settings, path)
            gone.append(path.relative_to(root).as_posix())
            log.info("deleted code package %s: no job refers to it (TLAB_CODE_TTL_DAYS=%g)", gone[-1],
                     settings.code_ttl_days)
    left = {p.stem for p in (root / "code").glob("*/*.zip")}
    for copy in (Path(settings.home) / "packages").glob("*.zip"):  # the scheduler's verified copies
        if copy.stem not in left and _older(copy, cutoff):
            copy.unlink(missing_ok=True)
    return gone


def referenced_packages(store: Store) -> set[tuple[str, str]]:
    """(owner, package id) of every job's ``code.package``, every job Redis holds, ``EXPIRE_BATCH`` at a time."""
    found: set[tuple[str, str]] = set()
    for ids in job_pages(store):
        pipe = store.r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(keys.job(job_id), ["owner", "spec"])
        for owner, raw in pipe.execute():
            try:
                package = ((json.loads(raw or "{}") or {}).get("code") or {}).get("package")
            except (ValueError, AttributeError):
                continue
            if owner and isinstance(package, str):
                found.add((owner, package))
    return found


def _older(path: Path, cutoff: float) -> bool:
    """A regular file (never a link a job planted) last written before ``cutoff``."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff
