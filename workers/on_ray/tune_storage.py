"""Where a sweep's Tune keeps its state, its trials' results and their checkpoints (``workers.sweep``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from objstore import Bucket
from workers.job import fence
from workers.job.bucket import bucket, pull_dir
from workers.job.fenced_fs import fenced


@dataclass(frozen=True)
class TuneStorage:
    """Where Tune keeps the sweep's state, its trials' results and their checkpoints: a directory every node sees.
    With a bucket as storage (``TLAB_STORAGE_URI``) that is the bucket, through its pyarrow filesystem: a trial on
    another host writes there, where the storage cache is each host's own (Ray refuses a path only the driver's
    host has); the driver reads the sweep's directory into its cache before it exports the best trial. Every write
    there is fenced to the driver's attempt (``workers.job.fenced_fs``): an ended attempt's Tune writes nothing.
    Without a bucket, the storage directory itself (one host, or a filesystem the hosts share)."""

    storage: str  # the local storage directory (with a bucket: its cache)
    job_id: str
    bucket: Bucket | None = None

    @property
    def root(self) -> str:
        return self.storage if self.bucket is None else self.bucket.path("")

    @property
    def fs(self) -> Any:
        """The bucket's pyarrow filesystem, fenced to this attempt; None: a local or shared directory."""
        return None if self.bucket is None else fenced(self.bucket.fs, self.job_id)

    def at(self, name: str) -> str:
        return os.path.join(self.storage, name) if self.bucket is None else self.bucket.path(name)

    def fetch(self, name: str) -> None:
        """Copy the bucket's ``name`` into the cache (nothing without a bucket)."""
        if self.bucket is not None:
            pull_dir(self.storage, name)

    def send_back(self, name: str) -> None:
        """Upload the cache's ``name`` to the bucket (a rerun's rewritten state; nothing without a bucket)."""
        if self.bucket is not None and fence.still_current(self.job_id, "Tune's state not copied to the bucket"):
            self.bucket.push(Path(self.storage) / name, name)


def tune_storage(storage: str, job_id: str, name: str) -> TuneStorage:
    """``TuneStorage`` for this sweep; with a bucket, what it holds of ``name`` copied here first (a restore and a
    rerun read Tune's state from the cache)."""
    shared = TuneStorage(storage, job_id, bucket())
    shared.fetch(name)
    return shared
