"""The cluster as the scheduler publishes it (``GET /v1/cluster``, ``tlab cluster``, the page's cluster view): per
node its CPUs, GPUs and host memory Ray may reserve, total and free, its GPU model, and each running job's share of
it (from the scheduler's ledger: the job's workers placed there times what each holds; a share of a card is a GPU
count below 1), and a GPU job's memory in use on that node as its ranks there last reported it with an epoch
(``torch.cuda.max_memory_allocated``, gathered by rank 0: ``workers.train.gpu_share.gpu_memory``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from api_schemas.jobs import ClusterView, NodeShare, NodeView
from service.core.store import Store
from service.rules.policy import ActiveJob, Node, free_resources, held_outside


def gpu_memory(store: Store, active: list[ActiveJob]) -> dict[str, tuple[float, ...]]:
    """Each running GPU job's peak GPU memory so far (MiB) per rank, from its last epoch record: every rank's when
    it reported them (``gpu_memory_mb_ranks``, one per placed worker), else rank 0's alone (none yet: left out).
    The record comes from the job's own process: anything but numbers is left out."""
    found = {}
    for job in active:
        if job.demand.gpus_per_worker > 0:
            m = store.last_metric(job.id) or {}
            ranks, first = m.get("gpu_memory_mb_ranks"), m.get("gpu_memory_mb")
            if isinstance(ranks, list) and len(ranks) == len(job.placement) and all(map(_number, ranks)):
                found[job.id] = tuple(float(r) for r in ranks)
            elif _number(first):
                found[job.id] = (float(first),)
    return found


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def node_shares(node_id: str, active: list[ActiveJob], gpu_memory: Mapping[str, Sequence[float]]) -> list[NodeShare]:
    """The running jobs with workers on ``node_id``, what they hold there, and the GPU memory their ranks there
    reported, summed (only rank 0's known: on rank 0's node)."""
    out = []
    for job in active:
        workers = sum(1 for placed in job.placement if placed == node_id)
        if workers:
            d = job.demand
            ranks = zip(gpu_memory.get(job.id, ()), job.placement, strict=False)  # only rank 0's: the first
            here = [m for m, placed in ranks if placed == node_id]
            out.append(NodeShare(job=job.id, workers=workers, cpus=workers * d.cpus_per_worker,
                                 gpus=workers * d.gpus_per_worker, gpu_memory_mb=sum(here) if here else None,
                                 memory_gb=workers * d.memory_gb if d.memory_gb else None))
    return out


def cluster_view(nodes: list[Node], active: list[ActiveJob], gpu_memory: Mapping[str, Sequence[float]] | None = None,
                 lost: Sequence[Node] = (), leaving: Collection[str] = ()) -> ClusterView:
    """The view the scheduler publishes each tick (``gpu_memory``: job -> its ranks' peak GPU MiB so far; ``lost``:
    the nodes Ray declared dead, listed after the alive ones with nothing free; ``leaving``: ids of the alive nodes
    leaving, ``tlab leave``)."""
    gpu_memory = gpu_memory or {}
    free = free_resources(nodes, active)
    outside = held_outside(nodes, active)
    return ClusterView(
        nodes=[NodeView(id=n.id, alive=True, cpus_total=n.cpus, cpus_free=free[n.id][0], gpus_total=n.gpus,
                        gpus_free=free[n.id][1], gpu_type=n.gpu_type, memory_gb_total=n.memory_gb,
                        memory_gb_free=None if n.memory_gb is None else free[n.id][2],
                        jobs=node_shares(n.id, active, gpu_memory), hostname=n.hostname, address=n.address,
                        leaving=n.id in leaving)
               for n in nodes]
        + [NodeView(id=n.id, alive=False, cpus_total=n.cpus, cpus_free=0.0, gpus_total=n.gpus, gpus_free=0.0,
                    gpu_type=n.gpu_type, memory_gb_total=n.memory_gb, hostname=n.hostname, address=n.address)
           for n in lost],
        cpus_total=sum(n.cpus for n in nodes), gpus_total=sum(n.gpus for n in nodes),
        cpus_free=sum(f[0] for f in free.values()), gpus_free=sum(f[1] for f in free.values()),
        running_jobs=[a.id for a in active], scheduler_alive=True, cpus_outside=outside[0], gpus_outside=outside[1],
        memory_gb_outside=outside[2],
        **memory_totals(nodes, free))


def memory_totals(nodes: list[Node], free: Mapping[str, list[float]]) -> dict[str, float | None]:
    """The memory Ray may reserve on the nodes that say, total and free (both None when no node says)."""
    known = [n for n in nodes if n.memory_gb is not None]
    if not known:
        return {"memory_gb_total": None, "memory_gb_free": None}
    return {"memory_gb_total": sum(n.memory_gb or 0.0 for n in known),
            "memory_gb_free": sum(max(0.0, free[n.id][2]) for n in known)}
