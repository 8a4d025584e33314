"""A failure as one line a user can read: ``epoch 3: loss is NaN``, ``mylab/models.py:88: NameError: ...``.

The Ray job's entrypoint (``workers.job.harness.job_main``) turns whatever ended the job into this line, writes it
to the job's stream as the error ``log`` event and prints it after ``FAILURE_MARK`` as a line of its log
(the scheduler's fallback); the full traceback goes to the job's log only. The line's format (one line, at
most ``MAX_REASON`` characters) is in ``api_schemas.reasons``; it names the innermost frame of the user's
own code when the error passed through it.
"""

from __future__ import annotations

import errno
import re
import shutil
import sysconfig
import traceback
from pathlib import Path

from api_schemas.reasons import one_line

OURS = ("workers", "teleport", "api_schemas", "service", "plots")  # this repository's packages
_REPO = Path(__file__).resolve().parents[2]  # (this file: workers/train/failure.py)
_STDLIB = sysconfig.get_paths()["stdlib"]
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)', re.MULTILINE)
_RAY_PACKAGE = re.compile(r"^.*/_ray_pkg_[^/]+/")  # where Ray unpacks a runtime_env working_dir


FULL_BYTES = 1 << 20  # a volume with less left is full (for a write that failed)


class JobFailed(RuntimeError):
    """A failure whose message is already the reason to show (the training loop said why)."""


def out_of_space(err: Exception, run_dir: Path, kept: list[Path]) -> JobFailed | None:
    """A checkpoint write that failed for want of space, as the job's one-line reason (never retried: the next
    try would write into the same full volume); None for any other error. torch.save's zip writer says only
    ``RuntimeError: ... iostream error``: a write that failed with less than ``FULL_BYTES`` left, its partial file
    still there, counts as one."""
    free = shutil.disk_usage(run_dir).free
    if getattr(err, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) and free >= FULL_BYTES:
        return None
    last = f"its last checkpoint ({kept[0].name}) is kept" if kept else "it had written no checkpoint yet"
    return JobFailed(f"checkpoint write failed: no space left on the storage volume ({free / 1e9:.2f} GB free at "
                     f"{run_dir}); {last}: free space, then continue it (`tlab continue`)")


def is_internal(path: str) -> bool:
    """A frame of Python, an installed library (torch, ray, numpy) or this repository's packages."""
    if path.startswith("<") or "/site-packages/" in path or "/dist-packages/" in path or path.startswith(_STDLIB):
        return True
    if _RAY_PACKAGE.match(path):
        return False  # the user's uploaded package, whatever its folders are called
    resolved = Path(path)
    return any(resolved.is_relative_to(_REPO / p) for p in OURS) or re.search(
        rf"/({'|'.join(OURS)})/(\w+/){{0,2}}\w+\.py$", path) is not None  # a copy of ours (a sub-package's too)


def shown_path(path: str) -> str:
    """A user's file as they know it: relative to their package (or to the working directory)."""
    inside = _RAY_PACKAGE.sub("", path)
    if inside != path:
        return inside
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def user_frame(frames: list[tuple[str, int]]) -> str | None:
    """``file:line`` of the innermost frame outside Python, the libraries and this repository."""
    for path, line in reversed(frames):
        if not is_internal(path):
            return f"{shown_path(path)}:{line}"
    return None


def root_cause(err: BaseException) -> tuple[BaseException, list[tuple[str, int]]]:
    """The exception that started it, and its frames (outermost first): Ray Train's errors carry a worker's
    exception without its traceback, and its traceback as text in their message."""
    from_ray = type(err).__module__.startswith("ray.")
    workers = getattr(err, "worker_failures", None)  # ray.train.WorkerGroupError: rank -> exception
    if from_ray and workers:
        text = str(err).split("Error Snippet]:", 1)[-1].split("[Rank ", 1)[0]  # the first group's traceback
        return workers[min(workers)], [(p, int(n)) for p, n in _FRAME.findall(text)]
    inner = getattr(err, "controller_failure", None) or getattr(err, "cause", None)  # ControllerError, RayTaskError
    if from_ray and isinstance(inner, BaseException):
        return root_cause(inner)
    return err, [(f.filename, f.lineno or 0) for f in traceback.extract_tb(err.__traceback__)]


def failure_reason(err: BaseException) -> str:
    """One line for the user: our own errors as their message (they name the field and the fix); any other
    as ``Type: message``, after ``file:line`` of the user's innermost frame when it passed through their code."""
    cause, frames = root_cause(err)
    message = str(cause).strip() or "(no message)"
    ours = type(cause).__module__.split(".", 1)[0] in OURS
    where = user_frame(frames)
    if ours and where is None:
        return one_line(message)
    text = f"{type(cause).__name__}: {message}"
    return one_line(f"{where}: {text}" if where else text)
