"""``DELETE`` of an ended job (``service.core.retention`` does the deleting): its Redis users first (Redis closes
their connections, so nothing of the job writes again), then its record and every key of it in Redis (each one the
service names, and whatever else a SCAN finds under ``tlab:job:<id>:``), then its files. From then on its id answers
404.

A job that has not ended is refused (409: cancel it first, ``POST .../cancel``); so is the parent of an
experiment that has not ended, which may still start from the parent's checkpoint (``service.api.lineage``).
"""

from __future__ import annotations

from service.core.errors import InvalidState
from service.core.retention import ENDED, delete_ended, unended_children
from service.core.settings import Settings
from service.core.store import Store
from service.launch.job_acl import drop_users


def delete_job(store: Store, settings: Settings, data: dict[str, str], route: str) -> None:
    """Delete the ended job ``data`` (its raw hash): Redis in one step, then its files. ``route``: experiments or
    sweeps, for the error's hint."""
    job_id, noun = data["id"], route.removesuffix("s")
    waiting = unended_children(store, data)
    if waiting:
        raise InvalidState(f"experiment {waiting[0]}, continued or forked from {job_id}, has not ended and may still "
                           f"start from its checkpoint: delete {job_id} once it has", field="id")
    if data.get("state") in ENDED.split(","):  # its users went the tick after it ended: unless that is now
        drop_users(store.r, job_id)
    done = delete_ended(store, settings, data)
    if done != 1:
        raise InvalidState(f"{noun} {job_id} is {done}: cancel it first (POST /v1/{route}/{job_id}/cancel, `tlab "
                           f"cancel {job_id}`), then delete it once it has ended", field="id")
