"""The queue in start order, and the cluster as the scheduler last saw it."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas.jobs import ClusterView, QueueView
from service.api.deps import CurrentUser, StateDep
from service.api.responses import AUTHED
from service.api.views import cluster_for, empty_cluster, queue_view
from service.core.sandbox_state import sandbox_state

router = APIRouter(prefix="/v1", tags=["cluster"], responses=AUTHED)


@router.get("/queue")
def queue(st: StateDep, user: CurrentUser) -> QueueView:
    """Queued experiments in the order they will start, with why each one waits; another user's job shows only
    as a position, priority and gang (admins see everything)."""
    return queue_view(st.store, user)


@router.get("/cluster")
def cluster(st: StateDep, user: CurrentUser) -> ClusterView:
    """Nodes with total and free CPUs/GPUs, and the running experiments, as the scheduler last saw them; another
    user's running job shows as its share of a node, without its id (admins see everything); whether jobs' code
    runs in a sandbox."""
    view, _ = st.cluster_view()
    shown = cluster_for(st.store, view, user) if view is not None else empty_cluster()
    return shown.model_copy(update={"sandbox": sandbox_state(st.settings)})
