"""How a failure reason travels from the workers to the service: one line, at most ``MAX_REASON`` characters,
marked with ``FAILURE_MARK`` on the Ray job's last log line (the scheduler's fallback when the stream has none)."""

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
