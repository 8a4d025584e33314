"""Files a job can write, read as data and never as paths to follow (docs/security.md).

A job's code can write its own storage directory (logs, artifacts, checkpoints) and, without a sandbox, every
file of the storage: a link planted there must not make the API or the scheduler read a secret, ``/dev/zero`` or a
FIFO. So everything they read from storage is opened relative to a trusted root's descriptor, one component at a
time with ``O_NOFOLLOW`` (``openat`` walk), must be a regular file (``fstat``), and is read with a size bound. A
link, a special file or a file over its bound is ``UnsafeFile``: one line naming the file, logged.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from service.core.errors import JobNotFound

log = logging.getLogger("tlab.storage")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never blocks the open


class UnsafeFile(JobNotFound):
    """A file in storage that is a link, sits under one, is no regular file, or is larger than its bound (404)."""


def refuse(rel: str, why: str) -> UnsafeFile:
    message = f"{rel[:200]} in storage {why}: refused (a job may have planted it)"
    log.warning("%s", message)
    return UnsafeFile(message, field="name")


def parts_of(rel: str | PurePosixPath) -> tuple[str, ...]:
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or any(p in ("..", ".") for p in parts):
        raise refuse(str(rel), "is not a plain relative name")
    return parts


def open_dir(root: str | Path, rel: str | PurePosixPath = "") -> int:
    """A descriptor of the directory ``root/rel``, no component of ``rel`` a link (``FileNotFoundError`` if
    missing). ``root`` itself is trusted (the service's configured storage) and may be a link."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts_of(rel) if str(rel) not in ("", ".") else ():
            fd = _step(fd, part, DIR_FLAGS, str(rel))
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd


def _step(parent: int, name: str, flags: int, rel: str) -> int:
    """Open ``name`` under the descriptor ``parent`` and close ``parent``; a link is ``UnsafeFile``."""
    try:
        return os.open(name, flags, dir_fd=parent)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise refuse(rel, "is, or lies under, a symbolic link or no directory") from None
        raise
    finally:
        os.close(parent)


def open_file(root: str | Path, rel: str | PurePosixPath, max_bytes: int | None = None) -> int:
    """A descriptor of the regular file ``root/rel`` opened without following a link anywhere below ``root``;
    ``FileNotFoundError`` if missing (``IsADirectoryError``: a directory), ``UnsafeFile`` if a link, a special file
    or larger than ``max_bytes``."""
    *dirs, name = parts_of(rel)
    fd = _step(open_dir(root, PurePosixPath(*dirs)) if dirs else open_dir(root), name, FILE_FLAGS, str(rel))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "a directory", str(rel))
        if not stat.S_ISREG(st.st_mode):
            raise refuse(str(rel), "is no regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise refuse(str(rel), f"is larger than {max_bytes} bytes")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(root: str | Path, rel: str | PurePosixPath, max_bytes: int) -> bytes:
    """The whole regular file ``root/rel`` (``open_file``), at most ``max_bytes`` of it even if it grows."""
    with os.fdopen(open_file(root, rel, max_bytes), "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise refuse(str(rel), f"is larger than {max_bytes} bytes")
    return data


def exists(root: str | Path, rel: str | PurePosixPath) -> bool:
    """Whether ``root/rel`` is a regular file reached without a link (a link or special file: False, logged)."""
    try:
        os.close(open_file(root, rel))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, UnsafeFile):
        return False
    return True


def files(root: str | Path, rel: str | PurePosixPath) -> Iterator[tuple[str, os.stat_result]]:
    """(name relative to ``root/rel``, its stat) of every regular file below the directory ``root/rel``, links
    and special files left out (logged), no link followed; nothing if the directory is missing."""
    try:
        fd = open_dir(root, rel)
    except (FileNotFoundError, NotADirectoryError):
        return
    yield from _walk(fd, PurePosixPath(), str(rel))


def _walk(fd: int, prefix: PurePosixPath, rel: str) -> Iterator[tuple[str, os.stat_result]]:
    try:
        with os.scandir(fd) as entries:
            found = sorted((e.name, e.stat(follow_symlinks=False)) for e in entries)
        for name, st in found:
            if stat.S_ISDIR(st.st_mode):
                with contextlib.suppress(FileNotFoundError, UnsafeFile):  # gone, or a link now
                    yield from _walk(_step(os.dup(fd), name, DIR_FLAGS, f"{rel}/{prefix / name}"), prefix / name, rel)
            elif stat.S_ISREG(st.st_mode):
                yield (prefix / name).as_posix(), st
            else:
                log.warning("%s/%s in storage is no regular file (a link?): left out", rel, prefix / name)
    finally:
        os.close(fd)
