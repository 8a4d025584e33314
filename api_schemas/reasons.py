"""How a failure reason travels from the workers to the service: one line, at most ``MAX_REASON`` characters,
marked with ``FAILURE_MARK`` on the Ray job's last log line (the scheduler's fallback when the stream has none); and
the signal a process's exit status says it died of (``killed_by``), which both sides read."""

from __future__ import annotations

MAX_REASON = 300
FAILURE_MARK = "TLAB-FAILURE: "


def one_line(text: str, limit: int = MAX_REASON) -> str:
    """``text`` with its whitespace runs as single spaces, cut to ``limit`` characters.

    >>> one_line("a\\n  b")
    'a b'
    """
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


ENDED_EXIT = 3  # a job's driver that ended itself: its attempt lost the service's Redis (workers.job.fence)


def killed_by(exit_code: int | None) -> int | None:
    """The signal that ended a process (a job's driver, its payload), from its exit status (``-N``, or ``128 + N``
    through a shell or bwrap); None for an exit of its own.

    >>> killed_by(-9), killed_by(137), killed_by(1)
    (9, 9, None)
    """
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    return exit_code - 128 if 128 < exit_code <= 128 + 64 else None
