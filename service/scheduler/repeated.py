"""A failure that repeats, logged without flooding the log."""

from __future__ import annotations

import logging
import time

from api_schemas.reasons import one_line


class RepeatedErrors:
    """A failing tick's traceback once; the same error again (Ray's head down for a while) as one line a minute."""

    def __init__(self, logger: logging.Logger, every_s: float = 60.0) -> None:
        self.log, self.every_s, self.last, self.said_at = logger, every_s, "", 0.0

    def report(self, err: Exception) -> None:
        text, now = f"{type(err).__name__}: {err}", time.monotonic()
        if text != self.last:
            self.log.error("scheduler tick failed; retrying", exc_info=err)
        elif now - self.said_at >= self.every_s:
            self.log.warning("scheduler tick still failing: %s", one_line(text))
        else:
            return
        self.last, self.said_at = text, now
