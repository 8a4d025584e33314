"""Where a sweep's Tune keeps its state, its trials' results and their checkpoints (``workers.sweep``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from objstore import Bucket
from workers.job.bucket import bucket, pull_dir


@dataclass(frozen=True)
class TuneStorage:
    """Where Tune keeps the sweep's state, its trials' results and their checkpoints: a directory every node sees.
    With a bucket as storage (``TLAB_STORAGE_URI``) that is the bucket, through its pyarrow filesystem: a trial on
    another host writes there, where the storage cache is each host's own (Ray refuses a path only the driver's
    host has); the driver reads the sweep's directory into its cache before it exports the best trial. Without a
    bucket, the storage directory itself (one host, or a filesystem the hosts share)."""

    storage: str  # the local storage directory (with a bucket: its cache)
    bucket: Bucket | None = None

    @property
    def root(self) -> str:
        return self.storage if self.bucket is None else self.bucket.path("")

    @property
    def fs(self) -> Any:
        """The bucket's pyarrow filesystem, or None (a local or shared directory)."""
        return None if self.bucket is None else self.bucket.fs

    def at(self, name: str) -> str:
        return os.path.join(self.storage, name) if self.bucket is None else self.bucket.path(name)

    def fetch(self, name: str) -> None:
        """Copy the bucket's ``name`` into the cache (nothing without a bucket)."""
        if self.bucket is not None:
            pull_dir(self.storage, name)

    def send_back(self, name: str) -> None:
        """Upload the cache's ``name`` to the bucket (a rerun's rewritten state; nothing without a bucket)."""
        if self.bucket is not None:
            self.bucket.push(Path(self.storage) / name, name)


def tune_storage(storage: str, name: str) -> TuneStorage:
    """``TuneStorage`` for this sweep; with a bucket, what it holds of ``name`` copied here first (a restore and a
    rerun read Tune's state from the cache)."""
    shared = TuneStorage(storage, bucket())
    shared.fetch(name)
    return shared
