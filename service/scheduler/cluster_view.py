"""The cluster as the scheduler publishes it (``GET /v1/cluster``, ``tlab cluster``, the page's cluster view): per
node its CPUs and GPUs, total and free, its GPU model, and each running job's share of it (from the scheduler's
ledger: the job's workers placed there times what each holds; a share of a card is a GPU count below 1)."""

from __future__ import annotations

from api_schemas.jobs import ClusterView, NodeShare, NodeView
from service.rules.policy import ActiveJob, Node, free_resources, held_outside


def node_shares(node_id: str, active: list[ActiveJob]) -> list[NodeShare]:
    """The running jobs with workers on ``node_id``, and what they hold there."""
    out = []
    for job in active:
        workers = sum(1 for placed in job.placement if placed == node_id)
        if workers:
            d = job.demand
            out.append(NodeShare(job=job.id, workers=workers, cpus=workers * d.cpus_per_worker,
                                 gpus=workers * d.gpus_per_worker))
    return out


def cluster_view(nodes: list[Node], active: list[ActiveJob]) -> ClusterView:
    """The view the scheduler publishes each tick."""
    free = free_resources(nodes, active)
    outside = held_outside(nodes, active)
    return ClusterView(
        nodes=[NodeView(id=n.id, alive=True, cpus_total=n.cpus, cpus_free=free[n.id][0], gpus_total=n.gpus,
                        gpus_free=free[n.id][1], gpu_type=n.gpu_type, jobs=node_shares(n.id, active))
               for n in nodes],
        cpus_total=sum(n.cpus for n in nodes), gpus_total=sum(n.gpus for n in nodes),
        cpus_free=sum(f[0] for f in free.values()), gpus_free=sum(f[1] for f in free.values()),
        running_jobs=[a.id for a in active], scheduler_alive=True, cpus_outside=outside[0], gpus_outside=outside[1])
