"""The bucket behind ``TLAB_STORAGE``, as the API and the scheduler see it (``objstore``; docs/operations.md,
Storage).

With a local (or shared) directory as ``TLAB_STORAGE`` nothing here does anything. With a bucket URI, the local
directory ``settings.storage_path`` (``TLAB_STORAGE_CACHE``) is a working copy: before the API lists or serves a
job's artifacts or logs it pulls from the bucket what that copy lacks or holds an older version of (logs: only a
longer one), so a job that ran on another node, or whose local directory was deleted, is still served. A bucket
that cannot be reached then is a warning in the API's log, and what the local copy holds is served.

``check``: a malformed URI, or a bucket that cannot be reached or does not exist, is one line naming
TLAB_STORAGE at the start of ``tlab up``, the scheduler and the API.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

from objstore import Bucket, StorageError, bucket_for, one_line
from service.core.settings import Settings

log = logging.getLogger(__name__)
AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION",
           "AWS_CA_BUNDLE", "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
ARTIFACTS, CHECKPOINT = "artifacts", "checkpoint.pt"  # workers.job.artifacts' names (the service does not import it)


def bucket(settings: Settings) -> Bucket | None:
    return bucket_for(settings.storage_uri) if settings.storage_uri else None


def check(settings: Settings, reach: bool = True) -> None:
    """A StorageError (one line) for a malformed TLAB_STORAGE URI or, with ``reach``, an unreachable bucket."""
    b = bucket(settings)
    if b is not None and reach:
        b.check()


def check_or_exit(settings: Settings, reach: bool = True) -> None:
    """``check``, and on failure the line on stderr and exit status 2 (a process's start)."""
    try:
        check(settings, reach)
    except StorageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def storage_env(settings: Settings) -> dict[str, str]:
    """What a Ray job needs to reach the bucket: its URI (``workers.job.bucket``) and the AWS variables pyarrow reads
    that this process has; {} without a bucket."""
    if not settings.storage_uri:
        return {}
    return {"TLAB_STORAGE_URI": settings.storage_uri, **{k: os.environ[k] for k in AWS_ENV if os.environ.get(k)}}


def _sync(settings: Settings, job_id: str, what: str, grow_only: bool = False, only: str = "") -> None:
    b = bucket(settings)
    if b is None:
        return
    try:
        b.pull(f"{job_id}/{what}", Path(settings.storage_path) / job_id / what, grow_only=grow_only, only=only)
        if what == ARTIFACTS:
            pull_checkpoint(b, settings, job_id)
    except Exception as err:  # the bucket is down: serve what the local copy holds
        log.warning("could not read experiment %s's %s from the bucket (TLAB_STORAGE): %s", job_id, what or only,
                    one_line(err))


def pull_checkpoint(b: Bucket, settings: Settings, job_id: str) -> None:
    """With no exported checkpoint.pt (a driver killed before its export), the newest checkpoint stands in
    (``service.api.artifacts.last_checkpoint``): pull its file when no checkpoint is here."""
    local = Path(settings.storage_path) / job_id
    if (local / ARTIFACTS / CHECKPOINT).is_file() or any(local.glob(f"checkpoint_*/{CHECKPOINT}")):
        return
    newest = b.newest(job_id, "checkpoint_", CHECKPOINT)
    if newest is not None:
        b.pull(f"{job_id}/{newest}", local / newest)


def sync_artifacts(settings: Settings, job_id: str) -> None:
    """Pull the job's artifacts the local copy lacks or holds an older version of (with a bucket)."""
    _sync(settings, job_id, ARTIFACTS, grow_only=False)


def sync_logs(settings: Settings, job_id: str) -> None:
    """Pull the job's log files the local copy lacks or holds a shorter version of (with a bucket)."""
    _sync(settings, job_id, "logs", grow_only=True)


def sync_checkpoints(settings: Settings, job_id: str) -> None:
    """Pull the job's kept checkpoints the local copy lacks (with a bucket): a continue or fork reads them."""
    _sync(settings, job_id, "", only="checkpoint_")


def delete(settings: Settings, job_id: str) -> None:
    """Remove the job's directory from the bucket (with one; a dry run's, which leaves nothing behind)."""
    b = bucket(settings)
    if b is None:
        return
    try:
        b.delete(job_id)
    except Exception as err:
        log.warning("could not delete %s from the bucket (TLAB_STORAGE): %s", job_id, one_line(err))


def fetch(settings: Settings, path: Path) -> bool:
    """Whether the content-addressed file ``path`` (a code package ``<sha256 hex>.zip`` under the storage
    directory) is here, downloaded from the bucket first if it is not (another API host stored it). A downloaded
    copy that does not hash to its name (written over in the bucket: jobs can write the bucket) is dropped."""
    if path.is_file():
        return True
    b = bucket(settings)
    if b is None:
        return False
    try:
        b.download(path.relative_to(settings.storage_path).as_posix(), path)
    except FileNotFoundError:
        return False
    except Exception as err:  # the bucket is down: as if it were not there, said in the log
        log.warning("could not read %s from the bucket (TLAB_STORAGE): %s", path, one_line(err))
    if path.is_file() and file_sha256(path) != path.stem:
        log.warning("%s in the bucket does not hash to its name: not used (someone wrote over it)", path)
        path.unlink(missing_ok=True)
    return path.is_file()


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def put(settings: Settings, path: Path, missing_only: bool = False) -> None:
    """Upload the file ``path`` (under the storage directory) to the bucket, with one (a code package);
    ``missing_only``: only when the bucket lacks it (an earlier upload failed)."""
    b = bucket(settings)
    if b is None:
        return
    rel = path.relative_to(settings.storage_path).as_posix()
    try:
        if missing_only and b.exists(rel):
            return
        b.upload(path, rel)
    except Exception as err:  # kept here still; a scheduler on another host will say it is missing
        log.warning("could not copy %s to the bucket (TLAB_STORAGE): %s", path, one_line(err))


def remove(settings: Settings, path: Path) -> None:
    """Remove the file ``path`` (under the storage directory: an expired code package) here and in the bucket."""
    path.unlink(missing_ok=True)
    b = bucket(settings)
    if b is None:
        return
    try:
        b.delete_file(path.relative_to(settings.storage_path).as_posix())
    except Exception as err:  # gone already, or the bucket is down: the next pass tries again
        log.warning("could not delete %s from the bucket (TLAB_STORAGE): %s", path, one_line(err))
