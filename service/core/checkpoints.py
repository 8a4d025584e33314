"""A job's kept checkpoints in storage, read as data (the job writes them: no link followed): what lineage starts
from (``service.api.lineage``), what a retry resumes from (``service.scheduler.deaths``) and what pruning keeps
(``service.core.storage_lifecycle``)."""

from __future__ import annotations

import json
import os
import stat

from service.core import safe_files, storage
from service.core.settings import Settings

META_BYTES = 1 << 16  # a checkpoint's meta.json is read up to this size


def checkpoint_dirs(settings: Settings, job_id: str) -> list[str]:
    """The names of the job's ``checkpoint_*`` directories, oldest first (names carry the time); links left out."""
    try:
        fd = safe_files.open_dir(settings.storage_path, job_id)
    except (FileNotFoundError, NotADirectoryError, safe_files.UnsafeFile):
        return []
    try:
        with os.scandir(fd) as entries:
            return sorted(e.name for e in entries if e.name.startswith("checkpoint_")
                          and stat.S_ISDIR(e.stat(follow_symlinks=False).st_mode))
    finally:
        os.close(fd)


def kept_epochs(settings: Settings, job_id: str, sync: bool = True) -> dict[int, str]:
    """{epochs trained: checkpoint directory name} of the job's kept checkpoints that hold a model (a diverged
    run's last one holds only its failure: its ``meta.json`` has no epoch); the newest directory per epoch.
    ``sync``: with a bucket, first pull what the local copy lacks."""
    if sync:
        storage.sync_checkpoints(settings, job_id)
    root = settings.storage_path
    found: dict[int, str] = {}
    for name in checkpoint_dirs(settings, job_id):  # oldest first; the job writes them: no link followed
        try:
            epoch = json.loads(safe_files.read_bytes(root, f"{job_id}/{name}/meta.json", META_BYTES)).get("epoch")
        except (OSError, ValueError, AttributeError, safe_files.UnsafeFile):
            continue
        if isinstance(epoch, int) and epoch >= 1 and safe_files.exists(root, f"{job_id}/{name}/checkpoint.pt"):
            found[epoch] = name
    return found
