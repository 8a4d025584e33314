"""Nodes leaving the cluster (``tlab leave``; recorded by the API: ``service.core.nodes_leaving``), as the scheduler
handles them each tick, before it reconciles:

1. a leaving node is left out of the nodes the scheduler plans with (nothing starts there, no preemption counts on
   its room); the cluster view still lists it, marked leaving;
2. each job with a worker placed there is stopped through the preemption path (``preempt.evict``, marked
   ``LEAVING_NODE``): SIGTERM, its driver exports from its last checkpoint, and once Ray let it go it is queued again
   with its age, to resume from that checkpoint elsewhere, its attempt not counted as a failure. Its log says why:
   ``the node HOST (ADDR) leaving``.

The node waits until no job of its own is placed there (``GET /v1/nodes/leave``), then stops its Ray node.
"""

from __future__ import annotations

from service.core import nodes_leaving
from service.core.store import Store
from service.rules.policy import ActiveJob, Node
from service.scheduler.preempt import LEAVING_NODE, Stopper, evict, stopping


def leaving_nodes(store: Store, nodes: list[Node], now: float) -> dict[str, Node]:
    """node id -> node, for the alive nodes at an address that is leaving."""
    leaving = nodes_leaving.current(store.r, now)
    return {n.id: n for n in nodes if n.address and n.address in leaving}


def evict_from_leaving_nodes(store: Store, launcher: Stopper, nodes: list[Node], active: list[ActiveJob],
                             now: float) -> set[str]:
    """Stop the jobs placed on a leaving node (module doc); returns the ids of the leaving nodes."""
    leaving = leaving_nodes(store, nodes, now)
    if not leaving:
        return set()
    raws = {d["id"]: d for d in store.raws(a.id for a in active)}
    for job in active:
        there = [node_id for node_id in job.placement if node_id in leaving]
        data = raws.get(job.id)
        if not there or data is None or stopping(data):
            continue
        cause = f"the node {leaving[there[0]].label} leaving"
        evict(store, launcher, data, cause, LEAVING_NODE, "its admin took it out of the cluster (`tlab leave`)", now)
    return set(leaving)
