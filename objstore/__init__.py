"""Storage on an S3-compatible bucket, through the filesystem layer Ray Train uses (``pyarrow.fs``).

``TLAB_STORAGE`` is a local directory by default. Given a URI instead (``s3://bucket/prefix?endpoint_override=
host:port&scheme=http``, parsed by ``pyarrow.fs.FileSystem.from_uri``; credentials from the standard AWS
environment variables), the bucket is the durable copy and a local directory (``TLAB_STORAGE_CACHE``) the
working copy: every part keeps reading and writing local files, the workers ``push`` a job's new and changed
files and ``pull`` what a node never saw, and the API pulls what it is asked for and does not hold.

This package imports only pyarrow and the standard library (tests/test_walls.py), so both ``workers/`` and
``service/`` use it. Names inside the bucket are ``<prefix>/<rel>`` with ``rel`` a '/'-separated relative name.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MTIME_SLACK_S = 2.0  # a bucket keeps whole seconds: a copy this much newer than ours is a different one
HINT = ("give a local directory, or s3://bucket/prefix?endpoint_override=host:port&scheme=http "
        "(credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
_pushed: dict[str, tuple[int, int]] = {}  # "<bucket path> <local file>" -> its (size, mtime_ns) when last uploaded


class StorageError(ValueError):
    """A malformed storage URI or an unreachable bucket: one line naming TLAB_STORAGE."""


@functools.cache
def bucket_for(uri: str) -> Bucket:
    """The ``Bucket`` of a storage URI, made once per process (its client is reused by every call)."""
    return Bucket(uri)


def is_uri(value: str) -> bool:
    """Whether a TLAB_STORAGE value is a URI (a bucket) rather than a local path."""
    return "://" in value


@dataclass(frozen=True)
class Remote:
    """One file in the bucket: its size and modification time (seconds since the epoch)."""

    size: int
    mtime: float


class Bucket:
    """The bucket (and prefix) a storage URI names."""

    def __init__(self, uri: str, setting: str = "TLAB_STORAGE") -> None:
        import pyarrow.fs as pafs

        self.uri, self.setting = uri, setting
        try:
            self.fs, root = pafs.FileSystem.from_uri(uri)
        except Exception as err:  # pyarrow's text repeats the URI, secret key included
            said = str(err).replace(uri, redact(uri))
            raise StorageError(f"{setting}={redact(uri)!r} is not a storage URI pyarrow reads ({said}): {HINT}") \
                from None
        self.root = root.strip("/")
        if not self.root:
            raise StorageError(f"{setting}={redact(uri)!r} names no bucket: {HINT}")
        self.bucket_name = self.root.split("/", 1)[0]

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel.strip('/')}" if rel.strip("/") else self.root

    def check(self) -> None:
        """Reach the bucket once: a StorageError (one line) if it cannot be reached or does not exist."""
        import pyarrow.fs as pafs

        try:
            info = self.fs.get_file_info(self.bucket_name)
        except Exception as err:
            raise StorageError(f"{self.setting}={redact(self.uri)!r}: the bucket cannot be reached "
                               f"({one_line(err)}): check the endpoint and the credentials") from None
        if info.type == pafs.FileType.NotFound:
            raise StorageError(f"{self.setting}={redact(self.uri)!r}: bucket {self.bucket_name!r} does not "
                               "exist: create it first") from None

    def ls(self, rel: str) -> dict[str, Remote]:
        """Every file under ``rel`` (recursive), by name relative to ``rel``; {} when there is none."""
        import pyarrow.fs as pafs

        base = self.path(rel)
        infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return {i.path[len(base) + 1:]: Remote(i.size or 0, i.mtime.timestamp() if i.mtime else 0.0)
                for i in infos if i.type == pafs.FileType.File}

    def newest(self, rel: str, prefix: str, holding: str) -> str | None:
        """The greatest name of a folder right under ``rel`` that starts with ``prefix`` and holds the file
        ``holding`` (checkpoints: their names carry the time), or None."""
        names = {n.split("/", 1)[0] for n in self.ls(rel) if n.startswith(prefix) and n.endswith(f"/{holding}")
                 and n.count("/") == 1}
        return max(names, default=None)

    def exists(self, rel: str) -> bool:
        """Whether the bucket holds the file ``rel``."""
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.path(rel)).type == pafs.FileType.File

    def open(self, rel: str) -> Any:
        """A readable binary stream of one file (``with bucket.open(rel) as f: f.read()``)."""
        return self.fs.open_input_stream(self.path(rel))

    def delete(self, rel: str) -> None:
        self.fs.delete_dir(self.path(rel))

    def delete_file(self, rel: str) -> None:
        self.fs.delete_file(self.path(rel))

    def push(self, local_dir: Path, rel: str, skip: tuple[str, ...] = (".",),
             remote: dict[str, Remote] | None = None) -> list[str]:
        """Upload the files under ``local_dir`` that are new or changed since the bucket's copy to ``rel``;
        names (relative) of what was uploaded. Symlinks and names with a part starting with one of ``skip``
        (hidden, half-written files) are left out, and so is a file removed since the listing (a checkpoint its run
        rotated out meanwhile). ``remote``: ``ls(rel)`` if the caller has it."""
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            return []
        sent = []
        for path in sorted(local_dir.rglob("*")):
            name = path.relative_to(local_dir).as_posix()
            if path.is_symlink() or not path.is_file() or any(p.startswith(skip) for p in name.split("/")):
                continue
            try:
                st, key = path.stat(), f"{self.path(join(rel, name))} {path}"
                if _pushed.get(key) == (st.st_size, st.st_mtime_ns):
                    continue
                if key not in _pushed:  # a fresh process: compare with the bucket's copy
                    remote = self.ls(rel) if remote is None else remote
                    theirs = remote.get(name)
                    # the same file, or one older than the bucket's (a file this host pulled earlier keeps the
                    # bucket's time then): not sent, so it never replaces what another host wrote since
                    same = (theirs is not None and theirs.size == st.st_size
                            and st.st_mtime <= theirs.mtime + MTIME_SLACK_S)
                    if same or (theirs is not None and st.st_mtime < theirs.mtime):
                        _pushed[key] = (st.st_size, st.st_mtime_ns)
                        continue
                self.upload(path, join(rel, name))
            except FileNotFoundError:
                if path.exists():  # not this file's: the bucket's side
                    raise
                continue  # removed since the listing (a checkpoint its run rotated out meanwhile): nothing to send
            _pushed[key] = (st.st_size, st.st_mtime_ns)
            sent.append(name)
        return sent

    def upload(self, path: Path, rel: str) -> None:
        with path.open("rb") as src, self.fs.open_output_stream(self.path(rel)) as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)

    def pull(self, rel: str, local_dir: Path, grow_only: bool = False, only: str = "") -> list[str]:
        """Download the files under ``rel`` that ``local_dir`` lacks or holds an older copy of; names pulled.
        ``grow_only`` (logs, which only grow): replace a local file only by a longer one, so a file this
        machine is still appending to is never replaced by the bucket's older copy. ``only``: names that start
        with it."""
        got, root = [], Path(local_dir).resolve()
        for name, theirs in sorted(self.ls(rel).items()):
            target = Path(local_dir) / name
            if not name.startswith(only) or any(p in ("", ".", "..") for p in name.split("/")) \
                    or not target.parent.resolve().is_relative_to(root) or not wanted(target, theirs, grow_only):
                continue  # (a folder here that is a link out of local_dir is never written through)
            self.download(join(rel, name), target, theirs.mtime)
            got.append(name)
        return got

    def download(self, rel: str, target: Path, mtime: float | None = None) -> None:
        """One file to ``target``, written under a hidden name and renamed (a reader never sees half of it)."""
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.pull-")  # one per download:
        tmp = Path(name)  # two threads pulling the same file never share it
        try:
            with self.open(rel) as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            if mtime:
                os.utime(tmp, (mtime, mtime))
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


def join(rel: str, name: str) -> str:
    """``rel/name`` ('/'-separated; ``rel`` may be empty or end with '/')."""
    return "/".join(p for p in (rel.strip("/"), name) if p)


def wanted(target: Path, theirs: Remote, grow_only: bool) -> bool:
    """Whether the bucket's copy should replace (or create) the local file ``target``."""
    if target.is_symlink():
        return False
    if not target.is_file():
        return True
    st = target.stat()
    if grow_only:
        return theirs.size > st.st_size
    return theirs.size != st.st_size and theirs.mtime > st.st_mtime or theirs.mtime > st.st_mtime + MTIME_SLACK_S


def redact(uri: str) -> str:
    """The URI without a secret key given in it (``secret_key=...``)."""
    if "secret_key=" not in uri:
        return uri
    head, _, query = uri.partition("?")
    parts = [p if not p.startswith("secret_key=") else "secret_key=***" for p in query.split("&")]
    return f"{head}?{'&'.join(parts)}"


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:300]
