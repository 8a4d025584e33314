"""What the SSE relay passes of a job's stream: a job's own entries are data checked against the event shape,
and only the service may say a state or end the stream.

A job writes its stream as its own Redis user (its raw ``XADD`` and ``DEL`` included: the sink's script needs the
one, the sweep's driver the other), so any entry could be forged, and the stream rewritten under any id. The
service's ``status`` entries that carry a state and a time (``state`` and ``at``: what clients read as the job's
state) and its ``end`` entries are written by the scripts of ``api_schemas.redis_scripts``, which list each one's
stream id *and the digest of its content* (``entry_digest``) in the job hash's ``service_events`` field — a key the
job's user cannot write. An entry passes when:

- its ``kind`` is one of ``keys.EVENT_KINDS`` and its ``data`` a JSON object;
- and, for an ``end`` or a ``status`` with a ``state`` and an ``at``, its id is one the service listed and what it
  holds has the digest listed beside that id: a job that deletes its stream and adds ``status: succeeded`` and
  ``end`` under the listed ids is not relayed (the job's own status records — ``running``, ``finished`` with its
  summary — carry no ``at`` and pass as data).

A job created before that field existed (no ``service_events`` at all) is relayed as it was; an id listed without a
digest (by a service that recorded none yet) is vetted by its id alone.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from redis import asyncio as aioredis

from api_schemas import keys
from api_schemas.redis_scripts import SERVICE_EVENTS_FIELD, entry_digest, service_events

log = logging.getLogger("tlab.events")
Entry = tuple[str, dict[str, str]]


def _claims(fields: dict[str, str]) -> bool | None:
    """Whether an entry speaks for the service (True), is a job's data (False), or is malformed (None)."""
    kind = fields.get("kind")
    if kind not in keys.EVENT_KINDS:
        return None
    try:
        data: Any = json.loads(fields.get("data", "{}"))
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    return kind == "end" or (kind == "status" and "state" in data and "at" in data)


class Vetter:
    """One job's filter; reads the service's ids and digests from the job hash when an entry needs them (they are
    written in the same script as the entry, so a fresh read always has an id the service wrote)."""

    def __init__(self, r: aioredis.Redis, job_id: str) -> None:
        self.r, self.job_id = r, job_id
        self.known = False  # the hash's field read at least once
        self.ours: dict[str, str] | None = {}  # id -> digest; None: a job from before the field, all trusted

    async def _read(self) -> None:
        self.known = True
        self.ours = service_events(await self.r.hget(keys.job(self.job_id), SERVICE_EVENTS_FIELD))

    def _forged(self, eid: str, fields: dict[str, str]) -> str:
        """Why a state or end entry is not the service's ('' when it is)."""
        if self.ours is None:
            return ""
        if eid not in self.ours:
            return "a state or end the service did not write"
        digest = self.ours[eid]
        if digest and digest != entry_digest(fields):
            return "a state or end under an id of the service's, with other content"
        return ""

    async def vet(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` less the malformed and the forged (each dropped one is logged)."""
        out: list[Entry] = []
        for eid, fields in entries:
            claim = _claims(fields)
            if claim and (not self.known or (self.ours is not None and eid not in self.ours)):
                await self._read()
            why = "malformed" if claim is None else self._forged(eid, fields) if claim else ""
            if why:
                log.warning("job %s: stream entry %s dropped from the relay (%s)", self.job_id, eid, why)
                continue
            out.append((eid, fields))
        return out
