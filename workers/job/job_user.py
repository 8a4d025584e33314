"""Who a payload is on the host, and what its supervisor prepares so that uid can do its work and nothing more.

Under a root supervisor each job gets a uid of its own, ``job_uid``: ``TLAB_JOB_UID_BASE`` (200000) plus a hash of
the job's id into ``TLAB_JOB_UIDS`` (100000) values, never 0, never a system account; its primary group is the jobs'
``TLAB_JOB_GID`` (199999), so a continued or forked job (another uid) can read the checkpoint the service chose for
it, and an admin opens data roots to the jobs with one ``chgrp``. Two jobs may draw the same uid (the odds are the
birthday bound over 100000): each still sees only its own directory (the mounts), not the other's processes (its own
PID namespace), and shares the other's process cap only.

Under an unprivileged supervisor (a service user's Ray: ``tlab up`` as root runs Ray so) the payload is that
service user on the host: bwrap cannot map another uid without privileges.

- ``own_job_dir``: the job's directory (made by the supervisor) owned by the job's uid, group-readable by the jobs;
- ``readable_code``: the job's code, unpacked by Ray under the node's 0700 temp directory with 0700 folders, and the
  checkpoint it starts from (a bucket's copy pulled by root, a Tune checkpoint), opened to others there (still
  unreachable from the host's other users: their parents stay closed);
- ``strip_setid``: no set-uid or set-gid bit survives in the job's directory (the seccomp filter refuses them too);
- ``limit_processes``: ``TLAB_SANDBOX_MAX_PROCS`` (1024) processes and threads for the payload's uid, no core dump.
"""

from __future__ import annotations

import hashlib
import os
import resource
import stat
from collections.abc import Mapping
from pathlib import Path

UID_BASE, UID_COUNT, GID = "TLAB_JOB_UID_BASE", "TLAB_JOB_UIDS", "TLAB_JOB_GID"
DEFAULT_UID_BASE, DEFAULT_UID_COUNT, DEFAULT_GID = 200_000, 100_000, 199_999
MAX_PROCS, DEFAULT_MAX_PROCS = "TLAB_SANDBOX_MAX_PROCS", 1024
UMASK = 0o027  # what the payload writes: its uid's, readable by the jobs' group (a child run's start), no one else


def _setting(environ: Mapping[str, str], name: str, default: int, low: int = 1) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < low:
        raise ValueError(f"{name}={raw!r}: give a whole number of at least {low}")
    return int(raw)


def rootful() -> bool:
    """Whether this supervisor is root: then the payload drops to ``job_uid`` (else it is this process's uid)."""
    return os.geteuid() == 0


def job_uid(job_id: str, environ: Mapping[str, str] = os.environ) -> int:
    """The host uid the job's payloads run as under a root supervisor (stable: every try and rank alike).

    >>> job_uid("abc", {}) == job_uid("abc", {}) and 200_000 <= job_uid("abc", {}) < 300_000
    True
    """
    base = _setting(environ, UID_BASE, DEFAULT_UID_BASE, low=1000)
    count = _setting(environ, UID_COUNT, DEFAULT_UID_COUNT)
    return base + int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big") % count


def job_gid(environ: Mapping[str, str] = os.environ) -> int:
    return _setting(environ, GID, DEFAULT_GID, low=1000)


def payload_ids(job_id: str) -> tuple[int, int]:
    """(uid, gid) of the job's payload on the host."""
    return (job_uid(job_id), job_gid()) if rootful() else (os.geteuid(), os.getegid())


def own_job_dir(job_dir: Path, uid: int, gid: int) -> None:
    """The job directory, made if missing, owned by the payload (0750: the jobs' group may read a checkpoint the
    service hands a child run), and what the trusted side put in it since (its log, checkpoints pulled back from a
    bucket) the payload's too: its own run's files. Links are changed themselves, never followed; a file with more
    than one link is left as it is (a hard link into the job's directory is not the job's to have)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    if not rootful():
        return
    fd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o750)
    finally:
        os.close(fd)
    for _root, dirs, files, dir_fd in os.fwalk(job_dir, follow_symlinks=False):
        for name in [*dirs, *files]:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if st.st_uid != uid and (stat.S_ISDIR(st.st_mode) or st.st_nlink == 1):
                    os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:  # gone meanwhile
                continue


def readable_code(tops: list[Path]) -> None:
    """Folders 0755 and files at least 0644 under each of ``tops`` (the job's code, which Ray unpacked with its umask;
    the checkpoint it starts from): the payload is another uid. Links are left alone (never followed)."""
    if not rootful():
        return
    for top in tops:
        for _root, _dirs, files, fd in os.fwalk(top, follow_symlinks=False):
            os.chmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | 0o755)
            for name in files:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and (st.st_mode & 0o444) != 0o444:
                    _fix(fd, name, stat.S_IMODE(st.st_mode) | 0o444)


def _fix(dir_fd: int, name: str, mode: int) -> None:
    """``chmod`` of a regular file by descriptor, opened without following a link."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def strip_setid(job_dir: Path) -> int:
    """Clear the set-uid and set-gid bits of every file under ``job_dir`` (links never followed); how many had one."""
    found = 0
    if not job_dir.is_dir() or job_dir.is_symlink():
        return 0
    for _root, dirs, files, fd in os.fwalk(job_dir, follow_symlinks=False):
        for name in [*files, *dirs]:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISLNK(st.st_mode):
                found += 1
                if stat.S_ISDIR(st.st_mode):
                    dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    try:
                        os.fchmod(dfd, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
                    finally:
                        os.close(dfd)
                else:
                    _fix(fd, name, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
    return found


def max_procs(environ: Mapping[str, str] = os.environ) -> int:
    return _setting(environ, MAX_PROCS, DEFAULT_MAX_PROCS)


def process_cap() -> int:
    """RLIMIT_NPROC for a payload: ``TLAB_SANDBOX_MAX_PROCS`` processes and threads of its uid. The limit counts the
    uid's tasks system-wide: under an unprivileged supervisor, which shares its uid with Ray, it is on top of what
    that uid runs now."""
    return max_procs() + (0 if rootful() else _tasks_of(os.getuid()))


def limit_processes(cap: int) -> None:
    """In the payload's process before it starts: ``cap`` processes (``process_cap``), no core dump (a crash hands
    the kernel's core handler nothing of the job's memory), and the umask that keeps its files its own."""
    resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.umask(UMASK)


def _tasks_of(uid: int) -> int:
    """Threads the uid runs now (``/proc/*/task``)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return count
