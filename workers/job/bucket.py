"""A job's directory and the bucket behind it, when storage is one (``objstore``; docs/operations.md, Storage).

The scheduler gives every Ray job ``TLAB_STORAGE`` (the local working directory, as always) and, when
``TLAB_STORAGE`` is a bucket URI, ``TLAB_STORAGE_URI`` (that URI). With no URI every function here does nothing.

- ``push(storage, job_id)``: upload the job directory's new and changed files (checkpoints, artifacts, logs);
  after the artifacts export (``final``: it first waits for the background upload, then drops the bucket's
  checkpoints the run no longer keeps) and when a process's log closes (a sweep's driver: its artifacts too).
  ``push_later``: the same on a background thread after each checkpoint (the training loop never waits for it).
  A failed push is a warning in the job's log, never the job's failure (the next push sends what it missed). A process
  that pinned its attempt pushes only after the attempt's check passed (``workers.job.fence``).
- ``pull_checkpoint(storage, job_id)``: before a run restores, the newest checkpoint the bucket holds when it is
  newer than any here (a job requeued onto a node that never saw it goes on from there); ``pull_dir``: one
  directory (a continued or forked job's parent checkpoint).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from objstore import Bucket, bucket_for, one_line
from workers.job import fence
from workers.job.artifacts import CHECKPOINT_FILE, checkpoints

ENV = "TLAB_STORAGE_URI"
RETRY_S = 30.0  # after a failed push, checkpoints are not pushed for this long (the end of a run always is)
_failed_at = [-RETRY_S]  # monotonic time of the last failed push
_uploads: list[Future[None]] = []  # the background push (push_later), the newest last
_uploader: ThreadPoolExecutor | None = None


def bucket() -> Bucket | None:
    """The bucket this job's storage is backed by, or None (a local or shared directory)."""
    uri = os.environ.get(ENV, "")
    return bucket_for(uri) if uri else None


def push_later(storage: str | Path, job_id: str) -> None:
    """``push(prune=True)`` on a thread of its own, after a checkpoint: neither the loop nor a stop waits for it.
    One at a time; while one waits to start, no other is queued (it will send the newest files too)."""
    global _uploader
    if bucket() is None:
        return
    if _uploads and not _uploads[-1].running() and not _uploads[-1].done():
        return
    if _uploader is None:
        _uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tlab-upload")
    _uploads[:] = [_uploader.submit(push, storage, job_id, True)]


def wait_uploads() -> None:
    """Return once the background push (if any) has ended: the final push lists the bucket after it."""
    for future in list(_uploads):
        future.exception()  # (push never raises: a failure is a warning line)


def push(storage: str | Path, job_id: str, prune: bool = False, final: bool = False) -> None:
    """Upload the new and changed files under ``<storage>/<job_id>``; with ``prune`` (the run directory's one
    writer), also delete the bucket's checkpoints no longer here (``TLAB_KEEP_CHECKPOINTS``). A checkpoint's push
    within ``RETRY_S`` of a failed one is skipped (an unreachable bucket would cost each epoch the client's
    retries); a ``final`` one (the end of a run: its driver, after the export) always tries."""
    b = bucket()
    if b is None or (prune and not final and time.monotonic() - _failed_at[0] < RETRY_S):
        return
    if not fence.still_current(job_id, "not copied to the bucket"):  # an ended attempt uploads and prunes nothing
        return
    if final:  # a checkpoint's upload still running would send what this one's prune deletes
        wait_uploads()
    local = Path(storage) / job_id
    try:
        remote = b.ls(job_id) if prune else None
        b.push(local, job_id, remote=remote)
        if remote is not None:  # the ones this run rotated out; never one newer than ours (another node's)
            kept = {p.name for p in local.glob("checkpoint_*")}
            for old in {n.split("/", 1)[0] for n in remote if n.startswith("checkpoint_")} - kept:
                if old < max(kept, default=""):
                    b.delete(f"{job_id}/{old}")
    except Exception as err:  # the job goes on; the next push sends what this one missed
        _failed_at[0] = time.monotonic()
        print(f"[tlab] warning: could not copy {local} to {b.uri.split('?')[0]}: {one_line(err)}",
              file=sys.stderr, flush=True)


def pull_dir(storage: str | Path, rel: str) -> list[str]:
    """Download the bucket's ``rel`` (a job's checkpoint directory) to ``<storage>/<rel>``; names pulled ([]
    without a bucket). An OSError naming TLAB_STORAGE when the bucket cannot be read."""
    b = bucket()
    if b is None:
        return []
    try:
        return b.pull(rel, Path(storage) / rel)
    except OSError as err:
        raise OSError(f"could not read {rel} from {b.uri.split('?')[0]} (TLAB_STORAGE): {one_line(err)}") from None


def pull_checkpoint(storage: str | Path, job_id: str) -> str | None:
    """When the bucket's newest checkpoint of the job is newer than every one here (none here; or this node ran an
    earlier attempt and another node went further since), pull it; the name pulled, or None. Checkpoint names
    carry their time (``workers.on_ray.driver.checkpoint_name``), so the greatest name is the newest."""
    b = bucket()
    if b is None:
        return None
    here = [p.name for p in checkpoints([Path(storage) / job_id])]
    try:
        name = b.newest(job_id, "checkpoint_", CHECKPOINT_FILE)
    except OSError as err:
        raise OSError(f"could not list experiment {job_id}'s checkpoints in {b.uri.split('?')[0]} "
                      f"(TLAB_STORAGE): {one_line(err)}") from None
    if name is None or name <= max(here, default=""):
        return None
    pull_dir(storage, f"{job_id}/{name}")
    print(f"[tlab] resuming from {name}, pulled from {b.uri.split('?')[0]}", file=sys.stderr, flush=True)
    return name
