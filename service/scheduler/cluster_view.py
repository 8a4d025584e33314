"""The cluster as the scheduler publishes it (``GET /v1/cluster``, ``tlab cluster``, the page's cluster view): per
node its CPUs and GPUs, total and free, its GPU model, and each running job's share of it (from the scheduler's
ledger: the job's workers placed there times what each holds; a share of a card is a GPU count below 1), and a
GPU job's memory in use as its rank 0 last reported it with an epoch (``torch.cuda.max_memory_allocated``)."""

from __future__ import annotations

from collections.abc import Mapping

from api_schemas.jobs import ClusterView, NodeShare, NodeView
from service.core.store import Store
from service.rules.policy import ActiveJob, Node, free_resources, held_outside


def gpu_memory(store: Store, active: list[ActiveJob]) -> dict[str, float]:
    """Each running GPU job's peak GPU memory so far (MiB), from its last epoch record (none yet: left out)."""
    found = {}
    for job in active:
        if job.demand.gpus_per_worker > 0:
            memory = (store.last_metric(job.id) or {}).get("gpu_memory_mb")
            if isinstance(memory, int | float) and not isinstance(memory, bool):
                found[job.id] = float(memory)
    return found


def node_shares(node_id: str, active: list[ActiveJob], gpu_memory: Mapping[str, float]) -> list[NodeShare]:
    """The running jobs with workers on ``node_id``, what they hold there, and (on the node of their rank 0) the
    GPU memory they reported."""
    out = []
    for job in active:
        workers = sum(1 for placed in job.placement if placed == node_id)
        if workers:
            d = job.demand
            memory = gpu_memory.get(job.id) if job.placement[0] == node_id else None
            out.append(NodeShare(job=job.id, workers=workers, cpus=workers * d.cpus_per_worker,
                                 gpus=workers * d.gpus_per_worker, gpu_memory_mb=memory))
    return out


def cluster_view(nodes: list[Node], active: list[ActiveJob], gpu_memory: Mapping[str, float] | None = None
                 ) -> ClusterView:
    """The view the scheduler publishes each tick (``gpu_memory``: job -> its rank 0's peak GPU MiB so far)."""
    gpu_memory = gpu_memory or {}
    free = free_resources(nodes, active)
    outside = held_outside(nodes, active)
    return ClusterView(
        nodes=[NodeView(id=n.id, alive=True, cpus_total=n.cpus, cpus_free=free[n.id][0], gpus_total=n.gpus,
                        gpus_free=free[n.id][1], gpu_type=n.gpu_type, jobs=node_shares(n.id, active, gpu_memory))
               for n in nodes],
        cpus_total=sum(n.cpus for n in nodes), gpus_total=sum(n.gpus for n in nodes),
        cpus_free=sum(f[0] for f in free.values()), gpus_free=sum(f[1] for f in free.values()),
        running_jobs=[a.id for a in active], scheduler_alive=True, cpus_outside=outside[0], gpus_outside=outside[1])
