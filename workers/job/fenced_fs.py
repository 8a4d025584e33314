"""A pyarrow filesystem that writes only while its attempt is the job's current one (``workers.job.fence``).

A sweep's Tune keeps its state, its trials' results and their checkpoints in the bucket through a pyarrow filesystem
(``workers.on_ray.tune_storage``), written by the sweep's driver and by its trials' actors on any host. Wrapped in
``fenced``, every write (a file opened for writing, a directory made, anything deleted, moved or copied) first asks
Redis whether the attempt that made the filesystem is still the job's: an ended attempt's Tune (a host cut off and
healed after the sweep moved on) fails its write with ``AttemptEnded`` and the bucket keeps the live attempt's files.
Reads are not fenced. The filesystem travels to the trials' actors as Tune sends it (pickled); its Redis connection
is made again where it lands.
"""

from __future__ import annotations

from typing import Any

import pyarrow.fs as pafs

from workers.job import fence


class FencedHandler(pafs.FileSystemHandler):
    """``inner``'s operations, each write checked first against ``attempt`` of ``job_id`` on ``redis_url``."""

    def __init__(self, inner: pafs.FileSystem, job_id: str, attempt: int, redis_url: str) -> None:
        self.inner, self.job_id, self.attempt, self.redis_url = inner, job_id, int(attempt), redis_url
        self._fence: fence.Fence | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # the connection is this process's own: made again where it lands
        return FencedHandler, (self.inner, self.job_id, self.attempt, self.redis_url)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FencedHandler) and (self.inner, self.job_id, self.attempt) == (
            other.inner, other.job_id, other.attempt)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((self.job_id, self.attempt))

    def check(self) -> None:
        """Return while the attempt is current; ``AttemptEnded`` once it is not (Redis unreachable: raised)."""
        if self._fence is None:
            self._fence = fence.Fence(fence.connect(self.redis_url), self.job_id, self.attempt)
        self._fence.check()

    # ---- reads: as the inner filesystem does them
    def get_type_name(self) -> str:
        return f"fenced+{self.inner.type_name}"

    def normalize_path(self, path: str) -> str:
        return self.inner.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(selector)

    def open_input_stream(self, path: str) -> Any:
        return self.inner.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.inner.open_input_file(path)

    # ---- writes: each checked first
    def create_dir(self, path: str, recursive: bool) -> None:
        self.check()
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.check()
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.check()
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.check()
        self.inner.delete_dir_contents("", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.check()
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.check()
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.check()
        self.inner.copy_file(src, dest)

    def open_output_stream(self, path: str, metadata: dict[str, str] | None) -> Any:
        self.check()
        return self.inner.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: dict[str, str] | None) -> Any:
        self.check()
        return self.inner.open_append_stream(path, metadata=metadata)


def fenced(inner: pafs.FileSystem, job_id: str) -> pafs.FileSystem:
    """``inner`` fenced to the attempt of ``job_id`` this process pinned; ``inner`` itself when none is (a run
    outside the service)."""
    pin = fence.pinned_at(job_id)
    if pin is None:
        return inner
    attempt, url = pin
    return pafs.PyFileSystem(FencedHandler(inner, job_id, attempt, url))
