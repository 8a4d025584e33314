"""Why a Ray job failed, in one line: the entrypoint's marked line in Ray's message, or the job's own last error."""

from __future__ import annotations

import json

from api_schemas import keys
from api_schemas.reasons import FAILURE_MARK
from service.core.store import Store


def last_error(store: Store, job_id: str) -> str:
    """The worker's own account of a failure: the last error ``log`` event in the job's stream."""
    for _eid, fields in store.r.xrevrange(keys.events(job_id), count=200):
        if fields.get("kind") == "log":
            data = json.loads(fields["data"])
            if data.get("level") == "error":
                return str(data.get("message", ""))
    return ""


def reason_from_ray(message: str) -> str:
    """A failed Ray job's own message (its status line and the tail of its logs) as one reason: the line
    the entrypoint marked, else the last line (an entrypoint that died before it could say why)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    marked = [line.split(FAILURE_MARK, 1)[1] for line in lines if FAILURE_MARK in line]
    return marked[-1] if marked else (lines[-1] if lines else "")
