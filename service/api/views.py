"""What the read routes answer, built from the store: job lists, the queue, the cluster view, metrics, logs.

No FastAPI here: each function takes the store (or plain data) and returns an ``api_schemas`` view or text.
"""

from __future__ import annotations

import csv
import io
import json
import time
from typing import Any, NamedTuple

from api_schemas import keys
from api_schemas.jobs import ClusterView, JobList, JobState, JobView, QueueEntry, QueueView, Role, UserPublic
from service.core.errors import Forbidden
from service.core.store import Store

PENDING_REASON = "waiting for the scheduler's next decision"


class JobFilter(NamedTuple):
    state: JobState | None
    owner: str | None
    tag: str | None


class Page(NamedTuple):
    cursor: str | None
    limit: int


def read_cluster_view(store: Store, tick_s: float) -> tuple[ClusterView | None, float]:
    """The scheduler's last published view and its age; ``scheduler_alive`` if it is younger than 5 ticks."""
    raw = store.r.get(keys.cluster())
    if not raw:
        return None, 0.0
    data = json.loads(raw)
    view = ClusterView.model_validate(data["view"])
    age = time.time() - float(data["at"])
    view.scheduler_alive = age < max(10.0, 5 * tick_s)
    return view, age


def cluster_for(store: Store, view: ClusterView, user: UserPublic) -> ClusterView:
    """The cluster as ``user`` may see it: another user's running job without its id (an admin sees all)."""
    if user.role == Role.ADMIN:
        return view
    ids = sorted({s.job for n in view.nodes for s in n.jobs if s.job} | set(view.running_jobs))
    mine = {i for i, owner in zip(ids, owners(store, ids), strict=True) if owner == user.name}
    nodes = [n.model_copy(update={"jobs": [s if s.job in mine else s.model_copy(update={"job": None})
                                           for s in n.jobs]}) for n in view.nodes]
    return view.model_copy(update={"nodes": nodes, "running_jobs": [j for j in view.running_jobs if j in mine]})


def owners(store: Store, ids: list[str]) -> list[str | None]:
    pipe = store.r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(keys.job(job_id), "owner")
    return list(pipe.execute())


def empty_cluster() -> ClusterView:
    """What ``/v1/cluster`` answers before any scheduler has reported."""
    return ClusterView(nodes=[], cpus_total=0, cpus_free=0, gpus_total=0, gpus_free=0, running_jobs=[],
                       scheduler_alive=False)


def _matches(data: dict[str, str], kind: str, flt: JobFilter) -> bool:
    return (data.get("kind", "experiment") == kind and not (flt.state and data["state"] != flt.state.value)
            and not (flt.tag and flt.tag not in json.loads(data.get("tags", "[]"))))


def list_jobs(store: Store, user: UserPublic, kind: str, flt: JobFilter, page: Page) -> JobList:
    """A page of ``kind`` jobs, newest first: a user's own (403 for another's ``owner``), an admin's any."""
    owner = flt.owner
    if user.role != Role.ADMIN:
        if owner not in (None, user.name):
            raise Forbidden("you can list only your own jobs", field="owner")
        owner = user.name
    items: list[JobView] = []
    cursor = page.cursor
    while True:
        ids, more = store.list_ids(owner, cursor, page.limit)
        for data in store.raws(ids):
            if not _matches(data, kind, flt):
                continue
            items.append(store.view(data["id"], data, with_progress=False))
            if len(items) == page.limit:
                return JobList(items=items, next_cursor=data["id"] if (more or data["id"] != ids[-1]) else None)
        if not more:
            return JobList(items=items, next_cursor=None)
        cursor = ids[-1]


def queue_view(store: Store, user: UserPublic) -> QueueView:
    """Queued jobs in the scheduler's order, each with why it waits (the scheduler publishes both). A non-admin
    sees another user's job only as its position, priority and gang: no id, owner, name or reason."""
    ids = store.r.zrange(keys.queue(), 0, -1)
    order = {k: json.loads(v) for k, v in store.r.hgetall(keys.queue_view()).items()}
    entries = []
    for data in store.raws(ids):
        q = order.get(data["id"], {})
        job = store.view(data["id"], data, with_progress=False)
        shown = user.role == Role.ADMIN or job.owner == user.name
        entries.append(QueueEntry(position=q.get("position", len(ids)), id=job.id if shown else None,
                                  owner=job.owner if shown else None, name=job.name if shown else None,
                                  priority=job.priority, demand=job.demand, created_at=job.created_at,
                                  pending_reason=q.get("reason", PENDING_REASON) if shown else None))
    entries.sort(key=lambda e: (e.position, e.created_at))
    return QueueView(items=entries)


def metrics_csv(points: list[dict[str, Any]]) -> str:
    """Epoch rows as CSV: one column per key any row has (``kind`` left out), in order of first appearance."""
    columns = list(dict.fromkeys(k for r in points for k in r if k != "kind"))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(points)
    return out.getvalue()


def log_text(driver_log: str | None, recs: list[dict[str, Any]]) -> str:
    """The Ray driver's log (if any), then the job's ``log`` and ``status`` events as JSON lines."""
    lines = [driver_log.rstrip("\n")] if driver_log else []
    lines += [json.dumps(rec) for rec in recs if rec.get("kind") in ("log", "status")]
    return "\n".join(lines) + "\n"
