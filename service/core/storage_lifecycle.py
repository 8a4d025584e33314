"""What an ended job keeps in storage, and what each user's jobs hold there (the ``max_storage_gb`` quota).

An ended experiment (and each trial of an ended sweep: ``prune_trials``) keeps its newest
``TLAB_KEEP_ENDED_CHECKPOINTS`` (1) checkpoints that hold a model, any a
continued or forked child names, the ones that hold no model (a diverged run's failure marker, a few bytes), and
its artifacts (``prune_ended``: the scheduler, once the job has left the active set). Running, a job keeps
``TLAB_KEEP_CHECKPOINTS`` (2). Its size is then counted once: the job hash's ``storage_bytes`` and its owner's
total in ``keys.storage_usage`` (a delete takes it off again: ``forget``); a submit is refused while the owner's
total is at or over their quota, naming both figures (``check_quota``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from api_schemas import keys
from api_schemas.jobs import TERMINAL, UserPublic
from api_schemas.lineage import StartFrom
from service.core import safe_files, storage
from service.core.checkpoints import checkpoint_dirs, kept_epochs
from service.core.errors import InvalidInput
from service.core.settings import Settings
from service.core.store import Store

log = logging.getLogger("tlab.scheduler")
GB = 1e9
SETTLE_BATCH = 100  # jobs ended from the queue settled per tick
ENDED = {s.value for s in TERMINAL}


def named_by_children(store: Store, data: dict[str, str]) -> set[str]:
    """The checkpoint directories of this job that its continued or forked children start from."""
    named = set()
    for child in json.loads(data.get("children") or "[]"):
        raw = store.r.hget(keys.job(child), "start_from")
        try:
            start = StartFrom.model_validate_json(raw) if raw else None
        except ValueError:
            continue
        if start is not None and start.job == data["id"]:
            named.add(start.checkpoint)
    return named


def surplus(settings: Settings, job_id: str, keep: set[str]) -> list[str]:
    """The checkpoint directories an ended job need not keep (``keep``: named ones that stay whatever)."""
    with_model = sorted(kept_epochs(settings, job_id, sync=False).items())  # (epochs, name), oldest first
    newest = {name for _epoch, name in with_model[-settings.keep_ended_checkpoints:]}
    models = {name for _epoch, name in with_model}
    return [d for d in checkpoint_dirs(settings, job_id) if d in models and d not in newest | keep]


def usage_of(path: Path, max_entries: int | None = None) -> tuple[int, int]:
    """(bytes of the regular files under ``path``, its entries: files, directories, links), links neither followed
    nor counted in bytes; the walk stops once it has seen more than ``max_entries`` (its time is bounded by them)."""
    size = entries = 0
    todo = [str(path)]
    while todo:
        try:
            listing = os.scandir(todo.pop())
        except OSError:  # gone meanwhile, or not a directory
            continue
        with listing:
            for entry in listing:
                entries += 1
                if max_entries is not None and entries > max_entries:
                    return size, entries
                try:
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        size += entry.stat(follow_symlinks=False).st_size
                except OSError:  # removed while we looked
                    continue
    return size, entries


def job_usage(settings: Settings, job_id: str, max_entries: int | None = None) -> tuple[int, int]:
    """(bytes, entries) of a job's files on the storage volume now (its directory, and a sweep's trials)."""
    root = Path(settings.storage_path)
    size, entries = usage_of(root / job_id, max_entries)
    more = None if max_entries is None else max(max_entries - entries, 0)
    sweep_size, sweep_entries = usage_of(root / f"sweep-{job_id}", more)
    return size + sweep_size, entries + sweep_entries


def job_bytes(settings: Settings, job_id: str) -> int:
    """What a job's files hold on the storage volume now (its directory, and a sweep's trials)."""
    return job_usage(settings, job_id)[0]


def prune_trials(settings: Settings, job_id: str) -> int:
    """An ended sweep's trials keep their newest ``TLAB_KEEP_ENDED_CHECKPOINTS`` checkpoints each (Tune kept 2 a
    trial while it ran, 4 under PBT; the sweep's artifacts, its best trial's, were exported as it ended). Every
    directory is opened by ``safe_files.open_dir``, no link followed: a trial's code wrote them. How many went."""
    gone, sweep = 0, f"sweep-{job_id}"
    for trial in _subdirs(settings, sweep):
        try:
            fd = safe_files.open_dir(settings.storage_path, f"{sweep}/{trial}")
        except (FileNotFoundError, NotADirectoryError, safe_files.UnsafeFile):  # gone, or a link put in its place
            continue
        try:
            kept = sorted(name for name in _subdirs_of(fd) if name.startswith("checkpoint_"))
            for name in kept[: -settings.keep_ended_checkpoints]:  # Tune's names: checkpoint_000012
                shutil.rmtree(name, dir_fd=fd)
                gone += 1
        finally:
            os.close(fd)
    return gone


def _subdirs(settings: Settings, rel: str) -> list[str]:
    """The directories (no links) in ``rel`` under storage; none when it is missing or a link."""
    try:
        fd = safe_files.open_dir(settings.storage_path, rel)
    except (FileNotFoundError, NotADirectoryError, safe_files.UnsafeFile):
        return []
    try:
        return _subdirs_of(fd)
    finally:
        os.close(fd)


def _subdirs_of(fd: int) -> list[str]:
    with os.scandir(fd) as entries:
        return [e.name for e in entries if e.is_dir(follow_symlinks=False)]


def prune_ended(store: Store, settings: Settings, data: dict[str, str]) -> int:
    """Drop an ended job's surplus checkpoints (an experiment's, here and in the bucket; a sweep's trials'), then
    count what it keeps against its owner (once); its size in bytes."""
    job_id = data["id"]
    root = Path(settings.storage_path)
    if data.get("kind", "experiment") == "experiment":
        for name in surplus(settings, job_id, named_by_children(store, data)):
            shutil.rmtree(root / job_id / name, ignore_errors=True)
            storage.delete(settings, f"{job_id}/{name}")
    else:
        prune_trials(settings, job_id)
    size = job_bytes(settings, job_id)
    if store.r.hsetnx(keys.job(job_id), "storage_bytes", str(size)):
        store.r.hincrby(keys.storage_usage(), data["owner"], size)
    return size


def settle(store: Store, settings: Settings, before: list[dict[str, str]]) -> None:
    """The jobs of ``before`` (the active set a tick began with) that have ended since, and those that ended from
    the queue after having run (``keys.unsettled``: a requeued job cancelled while it waited): pruned and counted."""
    gone = {d["id"] for d in before} - set(store.r.smembers(keys.active()))
    gone |= set(store.r.spop(keys.unsettled(), SETTLE_BATCH) or [])
    for data in store.raws(sorted(gone)):
        if data.get("state") in ENDED:
            try:
                prune_ended(store, settings, data)
            except OSError:
                log.exception("pruning the checkpoints of %s", data["id"])


def disk_reason(settings: Settings) -> str:
    """Why no job may start now: the storage volume has less than ``TLAB_MIN_FREE_GB`` free ('' when it has)."""
    if settings.min_free_gb <= 0:
        return ""
    path = Path(settings.storage_path)
    while not path.exists() and path != path.parent:  # not made yet: the volume it will be made on
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    if free >= settings.min_free_gb * GB:
        return ""
    return (f"storage nearly full: {free / GB:.2f} GB free at {settings.storage_path}, TLAB_MIN_FREE_GB="
            f"{settings.min_free_gb:g}: waiting until space is freed (`tlab rm` ended jobs)")


def forget(store: Store, data: dict[str, str]) -> None:
    """A deleted job's bytes off its owner's total."""
    size = int(data.get("storage_bytes") or 0)
    if size:
        store.r.hincrby(keys.storage_usage(), data["owner"], -size)


def used_bytes(store: Store, user: str) -> int:
    return max(0, int(store.r.hget(keys.storage_usage(), user) or 0))


def check_quota(store: Store, user: UserPublic) -> None:
    """422 naming ``max_storage_gb`` when the user's ended jobs already hold their quota (admins are not bound)."""
    cap = user.quotas.max_storage_gb
    if cap is None or user.role.value == "admin":
        return
    used = used_bytes(store, user.name)
    if used >= cap * GB:
        raise InvalidInput(f"your jobs hold {used / GB:.2f} GB of storage, your max_storage_gb quota is {cap:g}: "
                           "delete ended ones (`tlab rm ID`) or ask an admin to raise it", field="max_storage_gb")
