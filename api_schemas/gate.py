"""The one gate between what a job wrote and the trusted side (docs/security.md).

A job writes its storage directory and its own Redis keys (its run copy, its trials table, its stream), and a sweep
trial reports checkpoint directories on a pipe. The trusted side (a job's supervisor, a sweep's trial processes and
driver, the scheduler, the API) runs as a user that can read the service's secrets, so it takes an id, a name or a
path that came from there only through this module:

- ``job_id``, ``trial_id``, ``plain_name``: an id of the shape the service mints, or one plain path component
  (no ``/``, ``..``, NUL), else ``Refused``;
- ``named_under``: the components of a path someone named, lexically inside a root (no ``..``, no ``.``);
- ``open_dir``, ``real_dir``, ``regular_file``: a directory (a file) below a root the service chose, reached one
  component at a time with ``O_NOFOLLOW``: a link anywhere below the root is ``Refused``;
- ``copy_tree``: a directory tree copied as regular files only, never following a link, bounded in bytes and
  files, into a directory the trusted side made;
- ``remove_tree``: a directory below a root removed without following a link, its top one included.

Only the standard library: every part of the service may use it.

>>> job_id("18f3a2b4c5d-9e1f2a")
'18f3a2b4c5d-9e1f2a'
>>> job_id("/../../18f3a2b4c5d-9e1f2a")
Traceback (most recent call last):
...
api_schemas.gate.Refused: job id '/../../18f3a2b4c5d-9e1f2a' refused: not of the shape the service makes
>>> named_under("/srv/store", "/srv/store/job/trials/t1/report-x")
('job', 'trials', 't1', 'report-x')
>>> named_under("/srv/store", "/srv/store/job/../other")
Traceback (most recent call last):
...
api_schemas.gate.Refused: path '/srv/store/job/../other' refused: not a plain path below /srv/store
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from api_schemas.keys import JOB_ID_PATTERN

TRIAL_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # Tune's trial ids (``ab12c_00001``, Optuna's ``1a2b3c4d``)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never blocks the open
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_DEPTH = 32  # directory levels a copied tree may have
CHUNK = 1 << 20


class Refused(ValueError):
    """An id, name or path from job-writable state that the trusted side will not act on: one line saying why."""


def _shaped(what: str, value: object, pattern: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(pattern, value):
        raise Refused(f"{what} {str(value)[:80]!r} refused: not of the shape the service makes")
    return value


def job_id(value: object) -> str:
    """``value`` if it is a job id as the service makes them (``service.core.store.new_job_id``)."""
    return _shaped("job id", value, JOB_ID_PATTERN)


def trial_id(value: object) -> str:
    """``value`` if it is a trial id as Ray Tune makes them (letters, digits, ``_`` and ``-`` only)."""
    return _shaped("trial id", value, TRIAL_ID_PATTERN)


def plain_name(value: object) -> str:
    """``value`` if it is one plain path component: not empty, ``.`` or ``..``, no ``/`` and no NUL."""
    if not isinstance(value, str) or value in ("", ".", "..") or "/" in value or "\0" in value or len(value) > 255:
        raise Refused(f"name {str(value)[:80]!r} refused: not one plain path component")
    return value


def named_under(root: str | Path, named: str | Path) -> tuple[str, ...]:
    """The components of ``named`` (absolute, or relative to ``root``) below ``root``, read lexically: a path with
    a ``..`` or ``.`` component, or outside ``root``, is ``Refused``. Nothing is followed: see ``real_dir``."""
    text, base = str(named), os.path.abspath(root)
    parts = text.split("/")
    if "\0" in text or any(p in (".", "..") for p in parts):
        raise Refused(f"path {text[:200]!r} refused: not a plain path below {base}")
    rel = os.path.relpath(text, base) if os.path.isabs(text) else text
    out = tuple(p for p in rel.split("/") if p)
    if not out or out[0] in (".", ".."):
        raise Refused(f"path {text[:200]!r} refused: not a plain path below {base}")
    return out


def open_dir(root: str | Path, *parts: str) -> int:
    """A descriptor of the directory ``root/parts...``, each component opened with ``O_NOFOLLOW`` below ``root``
    (which the service chose, and may itself be a link): a link or non-directory there is ``Refused``,
    ``FileNotFoundError`` when missing."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            fd = _step(fd, plain_name(part), DIR_FLAGS, root, parts)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd


def _step(parent: int, name: str, flags: int, root: str | Path, parts: tuple[str, ...]) -> int:
    try:
        return os.open(name, flags, dir_fd=parent)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise Refused(f"{os.path.join(root, *parts)} refused: it is, or lies under, a link or no "
                          "directory") from None
        raise
    finally:
        os.close(parent)


def real_dir(root: str | Path, *parts: str) -> Path:
    """``root/parts...`` once checked to be a real directory with no link below ``root`` (see ``open_dir``)."""
    os.close(open_dir(root, *parts))
    return Path(root, *parts)


def regular_file(root: str | Path, *parts: str) -> bool:
    """Whether ``root/parts...`` is a regular file reached with no link below ``root``."""
    *dirs, name = parts
    try:
        fd = _step(open_dir(root, *dirs), plain_name(name), READ_FLAGS, root, parts)
    except (OSError, Refused):
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


@dataclass
class Copied:
    """What ``copy_tree`` copied, and the names it left out (links, special files)."""

    files: int = 0
    bytes: int = 0
    left_out: list[str] = field(default_factory=list)


def copy_tree(root: str | Path, parts: tuple[str, ...], dest: str | Path, max_bytes: int,
              max_files: int) -> Copied:
    """Copy the directory ``root/parts...`` into ``dest`` (an existing directory the trusted side made) as
    regular files and directories only: no link is followed or copied, nor any special file (they are listed in
    ``left_out``); the source is walked by descriptors with ``O_NOFOLLOW``, the copies are made new
    (``O_EXCL``) with modes 0644/0755. ``Refused`` past ``max_bytes`` bytes, ``max_files`` entries or
    ``MAX_DEPTH`` levels."""
    done = Copied()
    src = open_dir(root, *parts)
    try:
        dst = os.open(dest, DIR_FLAGS)
    except BaseException:
        os.close(src)
        raise
    _copy_dir(src, dst, "", done, max_bytes, max_files, 0)  # (closes both)
    return done


def _copy_dir(src: int, dst: int, where: str, done: Copied, max_bytes: int, max_files: int, depth: int) -> None:
    try:
        if depth > MAX_DEPTH:
            raise Refused(f"{where} refused: more than {MAX_DEPTH} directory levels")
        with os.scandir(src) as entries:
            found = sorted((e.name, e.stat(follow_symlinks=False).st_mode) for e in entries)
        for name, mode in found:
            rel = f"{where}/{name}" if where else name
            done.files += 1
            if done.files > max_files:
                raise Refused(f"{rel} refused: more than {max_files} files")
            if stat.S_ISDIR(mode):
                try:
                    inner = os.open(name, DIR_FLAGS, dir_fd=src)
                except OSError:  # a link now, or gone: left out
                    done.left_out.append(rel)
                    continue
                try:
                    os.mkdir(name, 0o755, dir_fd=dst)
                    out = os.open(name, DIR_FLAGS, dir_fd=dst)
                except BaseException:
                    os.close(inner)
                    raise
                _copy_dir(inner, out, rel, done, max_bytes, max_files, depth + 1)
            elif stat.S_ISREG(mode):
                _copy_file(src, dst, name, rel, done, max_bytes)
            else:
                done.left_out.append(rel)
    finally:
        os.close(src)
        os.close(dst)


def _copy_file(src: int, dst: int, name: str, rel: str, done: Copied, max_bytes: int) -> None:
    try:
        fin = os.open(name, READ_FLAGS, dir_fd=src)
    except OSError:  # a link now, or gone
        done.left_out.append(rel)
        return
    try:
        if not stat.S_ISREG(os.fstat(fin).st_mode):
            done.left_out.append(rel)
            return
        os.set_blocking(fin, True)
        fout = os.open(name, WRITE_FLAGS, 0o644, dir_fd=dst)
        try:
            while chunk := os.read(fin, CHUNK):
                done.bytes += len(chunk)
                if done.bytes > max_bytes:
                    raise Refused(f"{rel} refused: more than {max_bytes} bytes in all")
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fout, view):]
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def remove_tree(root: str | Path, *parts: str) -> None:
    """Remove the directory ``root/parts...`` and what is in it, following no link: the path to it is opened
    with ``O_NOFOLLOW`` (a link there is ``Refused``), and ``shutil.rmtree`` works from that descriptor, which
    removes links inside as links. Nothing when it is missing."""
    *dirs, name = parts
    try:
        parent = open_dir(root, *dirs)
    except FileNotFoundError:
        return
    try:
        mode = os.stat(plain_name(name), dir_fd=parent, follow_symlinks=False).st_mode
        if not stat.S_ISDIR(mode):
            raise Refused(f"{os.path.join(root, *parts)} refused: not a directory (a link?)")
        shutil.rmtree(name, dir_fd=parent)
    except FileNotFoundError:
        return
    finally:
        os.close(parent)
