"""Nodes leaving the cluster (``tlab leave``): the API records one (``POST /v1/nodes/leave``, with the join token the
node joined with), the scheduler places nothing more there and stops the jobs placed there, to resume elsewhere from
their last checkpoint (``service.scheduler.leaving``), and the node waits until none is left before it stops its Ray
node (``service.stack.leave``). A node is known by its address (one ``tlab join`` per machine); its record goes when
a node joins again from that address, or once its ``until`` is past. Only this module writes ``keys.nodes_leaving``.
"""

from __future__ import annotations

import json

import redis

from api_schemas import keys
from api_schemas.jobs import ACTIVE, ClusterView
from api_schemas.nodes import LeaveStatus
from service.core.store import Store

KEEP_S = 300.0  # a record outlives the node's own wait by this much (the node stops its Ray node by then)


def mark(r: redis.Redis, hostname: str, address: str, wait_s: float, now: float) -> LeaveStatus:
    """The node at ``address`` is leaving (asked again: the same record, its ``until`` moved on)."""
    raw = r.hget(keys.nodes_leaving(), address)
    since = float(json.loads(raw)["since"]) if raw else now
    status = LeaveStatus(hostname=hostname, address=address, since=since, until=now + wait_s + KEEP_S)
    r.hset(keys.nodes_leaving(), address, status.model_dump_json(exclude={"jobs"}))
    r.lpush(keys.wake(), address)  # the scheduler stops the jobs there at once, not at its next tick
    return status


def current(r: redis.Redis, now: float) -> dict[str, LeaveStatus]:
    """address -> the record of each node leaving now (those past their ``until`` are removed)."""
    found, past = {}, []
    for address, raw in r.hgetall(keys.nodes_leaving()).items():
        status = LeaveStatus.model_validate_json(raw)
        if status.until < now:
            past.append(address)
        else:
            found[address] = status
    if past:
        r.hdel(keys.nodes_leaving(), *past)
    return found


def clear(r: redis.Redis, address: str) -> None:
    """A node joined from ``address``: whatever left from there before is gone."""
    r.hdel(keys.nodes_leaving(), address)


def node_ids(r: redis.Redis, address: str, alive_only: bool = False) -> set[str]:
    """The Ray node ids at ``address`` in the scheduler's last view of the cluster (alive or not, unless
    ``alive_only``)."""
    raw = r.get(keys.cluster())
    view = ClusterView.model_validate(json.loads(raw)["view"]) if raw else None
    return {n.id for n in view.nodes if n.address == address and (n.alive or not alive_only)} if view else set()


def jobs_on(store: Store, ids: set[str]) -> list[str]:
    """The starting or running jobs with a worker placed on one of the nodes ``ids``."""
    raws = store.raws(sorted(store.r.smembers(keys.active())))
    return [d["id"] for d in raws
            if d.get("state") in ACTIVE and ids & set(json.loads(d.get("placement") or "[]"))]


def status(store: Store, address: str, now: float) -> LeaveStatus | None:
    """The record of the node leaving from ``address``, with the jobs still placed there; None: none is leaving."""
    found = current(store.r, now).get(address)
    if found is None:
        return None
    return found.model_copy(update={"jobs": jobs_on(store, node_ids(store.r, address))})
