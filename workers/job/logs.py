"""Every process of a job keeps its stdout and stderr in storage, so its log outlives Ray's memory of the job.

``capture(storage, job_id, name, attempt)`` tees file descriptors 1 and 2 (Python's prints, C extensions,
subprocesses that inherit them) through a pipe: each chunk still goes where it went (Ray's own log files) and is
appended to ``$TLAB_STORAGE/<job>/logs/attempt-<n>/<name>.log``. ``name`` is ``driver`` for the Ray job's
entrypoint (a 1-worker job trains there: its rank 0) and ``rank-<r>`` for a Ray Train worker.

The job's logs are capped together at ``TLAB_MAX_LOG_MB`` (default 20): each writer re-reads the size of the
job's log files every 64 KiB it writes, and when the cap is reached writes one line that says so and keeps no more.
The final lines are never lost: ``sys.stdout`` is line-buffered while captured, and leaving the context (a normal
end, an exception, the SIGTERM of a cancel, time limit or preemption, which the entrypoint turns into one) flushes
Python's buffers and drains the pipe before it returns.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from workers.job.bucket import push

CURRENT: Path | None = None  # the file this process is being captured in (``capture``), if any
RECHECK_BYTES = 64 * 1024  # a writer re-reads the job's total log size this often
DRAIN_TIMEOUT_S = 5.0  # at exit: how long to wait for the pipe to drain (a forked child may hold it open)


def max_log_bytes() -> int:
    return int(float(os.environ.get("TLAB_MAX_LOG_MB", "20")) * 2**20)


def logs_root(storage: str | Path, job_id: str) -> Path:
    return Path(storage) / job_id / "logs"


def log_bytes(root: Path) -> int:
    """The size of every log file of the job (all attempts, all processes)."""
    if not root.is_dir():
        return 0
    return sum(f.lstat().st_size for d in root.iterdir() if d.is_dir() for f in d.glob("*.log") if not f.is_symlink())


def cap_line(cap: int) -> bytes:
    return (f"\n[tlab] this job's logs reached their cap of {cap / 2**20:g} MB (TLAB_MAX_LOG_MB): "
            "output after this line is not kept\n").encode()


def open_log(path: Path, job_dir: Path) -> int:
    """``path`` (under ``job_dir``) opened to append, never through a link or to anything but a regular file: a job's
    sandboxed code writes in its directory, and this process (root, maybe) must not append to where it points."""
    fd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in path.relative_to(job_dir).parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=fd)
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        out = os.open(path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644,
                      dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise OSError(f"{path} is not a regular file: its log is not kept")
    return out


def write_all(fd: int, chunk: bytes) -> None:
    """``chunk`` to ``fd`` whole; a descriptor that fails (closed, full) loses it, never the writer."""
    view = memoryview(chunk)
    with contextlib.suppress(OSError):
        while view:
            view = view[os.write(fd, view):]


def pump(read_fd: int, write: Callable[[bytes], None]) -> None:
    """Each chunk read from ``read_fd`` to ``write`` until every write end is closed, then close it; it never stops
    early, or the writer's next print would fail (EPIPE)."""
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        write(chunk)
    os.close(read_fd)


class _Tee:
    """The pump: reads the pipe, writes each chunk to the original stdout and, within the cap, to the file."""

    def __init__(self, path: Path, root: Path, cap: int, out_fd: int) -> None:
        self.file = os.fdopen(open_log(path, root.parent), "ab", buffering=0)  # closed by close()
        self.root, self.cap, self.out_fd = root, cap, out_fd
        self.since_check = RECHECK_BYTES  # check at the first write
        self.full = False

    def write(self, chunk: bytes) -> None:
        write_all(self.out_fd, chunk)
        if self.full:
            return
        try:
            self.keep(chunk)
        except (OSError, ValueError):  # a full disk, a stale NFS handle: the log stops, never the job
            self.full = True

    def keep(self, chunk: bytes) -> None:
        if self.since_check >= RECHECK_BYTES:
            self.since_check = 0
            if log_bytes(self.root) + len(chunk) > self.cap:
                self.full = True
                self.file.write(cap_line(self.cap))
                return
        self.file.write(chunk)
        self.since_check += len(chunk)

    def close(self) -> None:
        self.file.close()


@contextlib.contextmanager
def capture(storage: str | Path, job_id: str, name: str, attempt: int) -> Iterator[Path]:
    """Keep this process's stdout and stderr in the job's log file ``name`` of ``attempt`` (see the module)."""
    root = logs_root(storage, job_id)
    path = root / f"attempt-{attempt}" / f"{name}.log"
    root.parent.mkdir(parents=True, exist_ok=True)  # the job's directory (``open_log`` makes the rest, no link)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    tee = _Tee(path, root, max_log_bytes(), saved[1])
    tee.file.write(f"[tlab] {name} of job {job_id}, attempt {attempt}: pid {os.getpid()} on "
                   f"{socket.gethostname()}\n".encode())
    read_fd, write_fd = os.pipe()
    pumping = threading.Thread(target=pump, args=(read_fd, tee.write), name="tlab-log-tee", daemon=True)
    pumping.start()
    for fd in (1, 2):
        os.dup2(write_fd, fd)
    os.close(write_fd)
    global CURRENT
    CURRENT = path
    line_buffered = getattr(sys.stdout, "line_buffering", True)
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    try:
        yield path
    finally:
        CURRENT = None
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(ValueError, OSError):
                stream.flush()
        for fd in (1, 2):  # the pipe's last write ends close here: the pump reads to its end and stops
            os.dup2(saved[fd], fd)
        pumping.join(DRAIN_TIMEOUT_S)
        if not pumping.is_alive():  # else a forked child still holds the pipe: the pump keeps what it writes
            tee.close()
            for fd in saved.values():
                os.close(fd)
        with contextlib.suppress(AttributeError, ValueError):
            sys.stdout.reconfigure(line_buffering=line_buffered)  # type: ignore[union-attr]
        push(storage, job_id)  # the bucket's copy of the job's files, when storage is one (``workers.job.bucket``)


def also_as(name: str) -> None:
    """Give the file this process is being captured in a second name in its attempt (``rank-0``: a 1-worker job's
    driver, which trains itself), so a reader of that rank finds it while it is written."""
    if CURRENT is not None:
        alias = CURRENT.with_name(f"{name}.log")
        with contextlib.suppress(FileExistsError):
            alias.symlink_to(CURRENT.name)


class StderrTail:
    """A child's stderr (a pipe's read end) passed on to this process's fd 2 as it comes, its last ``keep`` bytes
    kept: what a child that died without reporting its end said last (``workers.on_ray.supervisor``)."""

    def __init__(self, fd: int, keep: int = 8192) -> None:
        self.keep, self.kept = keep, b""
        self._thread = threading.Thread(target=pump, args=(fd, self._write), daemon=True, name="stderr-tail")
        self._thread.start()

    def _write(self, chunk: bytes) -> None:
        write_all(2, chunk)
        self.kept = (self.kept + chunk)[-self.keep:]

    def last_line(self, timeout: float = DRAIN_TIMEOUT_S) -> str:
        """The last line with text in it, once the pipe is drained (or ``timeout``: a forked child may hold it)."""
        self._thread.join(timeout)
        lines = self.kept.decode(errors="replace").replace("\r", "\n").splitlines()
        return next((line.strip() for line in reversed(lines) if line.strip()), "")
