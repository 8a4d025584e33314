"""Where a sweep's Tune keeps its state, its trials' results and their checkpoints (``workers.sweep``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.job.bucket import bucket, pull_dir


@dataclass(frozen=True)
class TuneStorage:
    """Where Tune keeps the sweep's state, its trials' results and their checkpoints: a directory every node sees.
    With a bucket as storage (``TLAB_STORAGE_URI``) that is the bucket, through its pyarrow filesystem: a trial on
    another host writes there, where the storage cache is each host's own (Ray refuses a path only the driver's
    host has); the driver reads the sweep's directory into its cache before it exports the best trial. Without a
    bucket, the storage directory itself (one host, or a filesystem the hosts share)."""

    root: str
    fs: Any = None  # pyarrow's filesystem of the bucket; None: a local or shared directory

    def at(self, name: str) -> str:
        return f"{self.root}/{name}" if self.fs is not None else os.path.join(self.root, name)

    def fetch(self, storage: str, name: str) -> None:
        """Copy the bucket's ``name`` into the cache (nothing without a bucket)."""
        if self.fs is not None:
            pull_dir(storage, name)

    def send_back(self, local: str, name: str) -> None:
        b = bucket()
        if b is not None:
            b.push(Path(local), name)


def tune_storage(storage: str, name: str) -> TuneStorage:
    """``TuneStorage`` for this sweep; with a bucket, what it holds of ``name`` copied here first (a restore and a
    rerun read Tune's state from the cache)."""
    b = bucket()
    if b is None:
        return TuneStorage(storage)
    pull_dir(storage, name)
    return TuneStorage(b.path(""), b.fs)
