"""Who starts next: a pure function of the queue, the running jobs, the cluster and each user's usage.

Order: priority (higher first), then fair share (the user with less decayed recent usage first;
starting a job charges its owner at once, so equal users alternate), then age. A job starts only
when its whole gang of workers fits on the free resources of the cluster's nodes now (what the
running jobs leave, and never more than Ray itself reports free), and within its owner's quotas
(max_running_jobs, and max_gpus/max_cpus/max_memory_gb counted over all their starting/running jobs plus this one).
A job over quota is skipped (it does not hold up other users). The first job that finds no room
reserves what it is short of: later jobs that need that resource wait behind it, so big gangs are
not starved by streams of small ones; jobs needing only other resources still start.

Host memory is the third resource: a gang's ``resources.memory_gb`` per worker against Ray's ``memory`` resource
on each node (what Ray reserves for it: ``service.launch.ray_cluster.driver_options``), so a job whose memory
Ray cannot reserve now waits here, saying so, rather than in Ray as ``starting``; a job without ``memory_gb`` holds
none. A node whose memory is not known does not limit it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from api_schemas.jobs import Demand, Quotas

CPU_WEIGHT = 0.125  # a CPU counts as 1/8 of a GPU in fair-share usage
MEMORY_WEIGHT = 1 / 64  # a GiB of resources.memory_gb counts as 1/64 of a GPU (a node's memory per GPU, as 8 CPUs)
EPS = 1e-9
MEMORY_NOISE_GB = 0.05  # less memory than this held beyond the ledger is not reported


def per_worker(demand: Demand) -> tuple[float, float, float]:
    """What one worker of the gang holds on its node: CPUs, GPUs, GiB of host memory (none asked: 0)."""
    return demand.cpus_per_worker, demand.gpus_per_worker, demand.memory_gb or 0.0


def take(room: list[float], demand: Demand, workers: int = 1) -> None:
    """``room`` (a node's [CPUs, GPUs, memory GiB] free) less ``workers`` of the gang's workers (< 0: given back)."""
    for i, held in enumerate(per_worker(demand)):
        room[i] -= workers * held


def weight(demand: Demand) -> float:
    """Fair-share cost of a gang per second: GPUs + CPUs/8 + memory GiB/64."""
    return demand.gpus + CPU_WEIGHT * demand.cpus + MEMORY_WEIGHT * demand.memory


def node_label(node_id: str, hostname: str | None, address: str | None) -> str:
    """``host (address)``, ``address`` or ``host`` as known, else the id's first 12 characters."""
    if hostname and address and hostname != address:
        return f"{hostname} ({address})"
    return hostname or address or node_id[:12]


@dataclass(frozen=True)
class Node:
    id: str
    cpus: float
    gpus: float
    # what Ray itself reports in use on the node now (None: not known): on a shared cluster other Ray work,
    # or a finished job's actors still being released, can hold more than Teleport Lab's own ledger says
    cpus_used: float | None = None
    gpus_used: float | None = None
    gpu_type: str | None = None  # the node's GPU model (Ray's accelerator_type:<name> resource); None: not known
    memory_gb: float | None = None  # Ray's ``memory`` resource on the node in GiB; None: not known (no limit)
    memory_used_gb: float | None = None  # what Ray reports reserved of it now; None: not known
    hostname: str | None = None  # the machine's name (its Ray node name), None: not known
    address: str | None = None  # the node's IP, None: not known

    @property
    def label(self) -> str:
        """How people name the node: ``host (address)``, else its id's first 12 characters."""
        return node_label(self.id, self.hostname, self.address)

    def room(self) -> list[float]:
        """[CPUs, GPUs, memory GiB] of the whole node (memory not known: without end)."""
        return [self.cpus, self.gpus, math.inf if self.memory_gb is None else self.memory_gb]


@dataclass(frozen=True)
class QueuedJob:
    id: str
    owner: str
    priority: int
    created_at: float
    demand: Demand
    after: tuple[str, ...] = ()  # jobs that must succeed first (service.rules.after)


@dataclass(frozen=True)
class ActiveJob:
    id: str
    owner: str
    demand: Demand
    placement: tuple[str, ...]  # node id per worker


@dataclass
class Decision:
    starts: list[tuple[QueuedJob, list[str]]] = field(default_factory=list)  # (job, node per worker)
    order: list[tuple[str, str]] = field(default_factory=list)  # still queued, in order: (id, why it waits)
    # the first job that found no room: the one that may preempt (service.rules.victims)
    reserved: QueuedJob | None = None


def _ledger_free(nodes: list[Node], active: list[ActiveJob]) -> dict[str, list[float]]:
    free = {n.id: n.room() for n in nodes}
    for job in active:
        for node_id in job.placement:
            if node_id in free:
                take(free[node_id], job.demand)
    return free


def free_resources(nodes: list[Node], active: list[ActiveJob]) -> dict[str, list[float]]:
    """node id -> [free CPUs, free GPUs, free memory GiB]: what the active jobs' gangs leave, and never more than
    Ray itself reports free (a gang that Ray cannot place would wait inside Ray with no reason shown)."""
    free = _ledger_free(nodes, active)
    for n in nodes:
        for i, (total, used) in enumerate(((n.cpus, n.cpus_used), (n.gpus, n.gpus_used),
                                           (n.memory_gb, n.memory_used_gb))):
            if total is not None and used is not None:
                free[n.id][i] = min(free[n.id][i], total - used)
    return free


def held_outside(nodes: list[Node], active: list[ActiveJob]) -> tuple[float, float, float]:
    """CPUs, GPUs and memory GiB that Ray reports in use beyond what Teleport Lab's active jobs hold."""
    ledger, free = _ledger_free(nodes, active), free_resources(nodes, active)
    cpus, gpus, memory = (sum(max(0.0, ledger[k][i] - free[k][i]) for k in free if math.isfinite(ledger[k][i]))
                          for i in range(3))  # a node's memory not known: nothing to compare
    # a sweep's trial drivers hold 1 MiB tokens (workers.sweep.DRIVER_MEMORY) the ledger does not count: not news
    return cpus, gpus, memory if memory >= MEMORY_NOISE_GB else 0.0


def place(demand: Demand, free: dict[str, list[float]]) -> list[str] | None:
    """A node per worker (packing the fullest-fitting nodes first), or None if the gang does not fit."""
    left = {k: list(v) for k, v in free.items()}
    need = per_worker(demand)
    out: list[str] = []
    for _ in range(demand.workers):
        fitting = [k for k, room in left.items() if all(r + EPS >= n for r, n in zip(room, need, strict=True))]
        if not fitting:
            return None
        # prefer the node already used by this gang (locality), then the one with the least room left
        node = min(fitting, key=lambda k: (k not in out, left[k][1], left[k][0]))
        take(left[node], demand)
        out.append(node)
    return out


def of_type(free: dict[str, list[float]], nodes: list[Node], demand: Demand) -> dict[str, list[float]]:
    """``free`` on the nodes with the GPU model the gang asks for (``resources.gpu_type``; any node without one)."""
    if not demand.gpu_type:
        return free
    typed = {n.id for n in nodes if n.gpu_type == demand.gpu_type}
    return {k: v for k, v in free.items() if k in typed}


def never_fits(demand: Demand, nodes: list[Node]) -> str | None:
    """Why the gang cannot fit even an empty cluster (None if it can)."""
    if place(demand, of_type({n.id: n.room() for n in nodes}, nodes, demand)) is not None:
        return None
    if demand.gpu_type and not any(n.gpu_type == demand.gpu_type for n in nodes):
        models = sorted({n.gpu_type for n in nodes if n.gpu_type}) or ["none known"]
        return (f"resources.gpu_type={demand.gpu_type} but no node has that GPU model (the cluster has: "
                f"{', '.join(models)}): name one of those, or drop gpu_type")
    most_cpu = max((n.cpus for n in nodes), default=0)
    most_gpu = max((n.gpus for n in nodes), default=0)
    total_gpu = sum(n.gpus for n in nodes)
    total_cpu = sum(n.cpus for n in nodes)
    if demand.gpus_per_worker > most_gpu + EPS:
        return (f"resources.gpus_per_worker={demand.gpus_per_worker:g} but the largest node has {most_gpu:g} GPUs: "
                "lower gpus_per_worker (and raise workers)")
    if demand.cpus_per_worker > most_cpu + EPS:
        return (f"resources.cpus_per_worker={demand.cpus_per_worker:g} but the largest node has {most_cpu:g} CPUs: "
                "lower cpus_per_worker")
    most_memory = max((n.room()[2] for n in nodes), default=0)
    if (demand.memory_gb or 0) > most_memory + EPS:
        return (f"resources.memory_gb={demand.memory_gb:g} but the largest node has {most_memory:.1f} GiB of memory "
                "Ray can reserve: lower memory_gb (and raise workers)")
    memory = f", {demand.memory:g} GiB" if demand.memory_gb else ""
    total_memory = f", {sum(n.room()[2] for n in nodes):.1f} GiB" if demand.memory_gb else ""
    return (f"resources: {gang_text(demand, ' workers')} = {demand.cpus:g} CPUs, {demand.gpus:g} "
            f"GPUs{memory}; the whole cluster has {total_cpu:g} CPUs, {total_gpu:g} GPUs{total_memory}: lower "
            "resources.workers")


def totals(free: dict[str, list[float]]) -> list[float]:
    """[CPUs, GPUs, memory GiB] free over all nodes (a node over-held counts 0, not less)."""
    return [sum(max(0.0, room[i]) for room in free.values()) for i in range(3)]


def _describe_free(free: dict[str, list[float]], demand: Demand) -> str:
    cpus, gpus, memory = totals(free)
    # memory only for a gang that asks for it, and where it is known
    held = f", {memory:.1f} GiB of memory" if demand.memory_gb and math.isfinite(memory) else ""
    return f"{cpus:g} CPUs, {gpus:g} GPUs{held} free on {len(free)} node(s)"


def _outside(cpus: float, gpus: float, memory: float) -> str:
    """What a waiting job's reason says of Ray's use beyond the running jobs ('' when there is none)."""
    if max(cpus, gpus, memory) <= EPS:
        return ""
    held = f", {memory:.1f} GiB" if memory > EPS else ""
    return (f" (Ray reports {cpus:g} CPUs, {gpus:g} GPUs{held} in use beyond Teleport Lab's running jobs: other Ray "
            "work on the cluster, or a finished job's workers still being released)")


def gang_text(demand: Demand, noun: str = "") -> str:
    """``2 x (1 CPU, 0.5 GPU, 4 GiB)``: the workers and what each holds (memory only where it asks some)."""
    memory = f", {demand.memory_gb:g} GiB" if demand.memory_gb else ""
    return f"{demand.workers}{noun} x ({demand.cpus_per_worker:g} CPU, {demand.gpus_per_worker:g} GPU{memory})"


def _short(demand: Demand, free: dict[str, list[float]]) -> tuple[bool, ...]:
    """What the first gang without room is short of (CPUs, GPUs, memory): later gangs that need any of it wait."""
    need = per_worker(demand)
    biggest = max(free.values(), key=lambda room: (room[1], room[0]), default=[0.0, 0.0, 0.0])
    short = tuple(demand.workers * n > t + EPS or n > b + EPS
                  for n, t, b in zip(need, totals(free), biggest, strict=True))
    # room in total but fragmented across nodes: hold all it needs
    return short if any(short) else tuple(n > 0 for n in need)


@dataclass
class Held:
    """What a user's starting/running jobs hold: the quotas' measure."""

    jobs: int = 0
    gpus: float = 0.0
    cpus: float = 0.0
    memory: float = 0.0

    def add(self, demand: Demand) -> None:
        self.jobs, self.gpus, self.cpus = self.jobs + 1, self.gpus + demand.gpus, self.cpus + demand.cpus
        self.memory += demand.memory


def _quota_block(job: QueuedJob, quotas: Quotas, held: Held) -> str | None:
    """Why starting ``job`` now would take its owner over a quota (None: within them all)."""
    if held.jobs >= quotas.max_running_jobs:
        return f"quota: {job.owner} has {held.jobs} of max_running_jobs={quotas.max_running_jobs} jobs running"
    if held.gpus + job.demand.gpus > quotas.max_gpus + EPS:
        return f"quota: needs {job.demand.gpus:g} GPUs; {job.owner} holds {held.gpus:g} of max_gpus={quotas.max_gpus:g}"
    if held.cpus + job.demand.cpus > quotas.max_cpus + EPS:
        return f"quota: needs {job.demand.cpus:g} CPUs; {job.owner} holds {held.cpus:g} of max_cpus={quotas.max_cpus:g}"
    cap = quotas.max_memory_gb
    if cap is not None and held.memory + job.demand.memory > cap + EPS:
        return f"quota: needs {job.demand.memory:g} GiB; {job.owner} holds {held.memory:g} of max_memory_gb={cap:g}"
    return None


def named(job_id: str, owner: str, reader: str | None) -> str:
    """A job as a reason shown to ``reader`` (the owner of the job the reason is about) names it: by its id when it
    is theirs, else as "another user's job" (another user's ids are not theirs to learn). None: by its id."""
    return job_id if reader is None or owner == reader else "another user's job"


def decide(queued: list[QueuedJob], active: list[ActiveJob], nodes: list[Node], usage: dict[str, float],
           quotas: dict[str, Quotas], start_charge_s: float = 60.0, blocked: dict[str, str] | None = None
           ) -> Decision:
    """Which queued jobs start now (and where), and the order and reason of those that wait. ``blocked`` (job id
    -> why: waiting for a dependency) keeps a job in its place in the order without starting or reserving."""
    free = free_resources(nodes, active)
    outside = _outside(*held_outside(nodes, active))
    usage = dict(usage)
    held: dict[str, Held] = {}
    for job in active:
        held.setdefault(job.owner, Held()).add(job.demand)

    # each user's jobs in (priority, age) order; the users' heads compete on (priority, usage, age)
    per_user: dict[str, list[tuple[int, float, str, QueuedJob]]] = {}
    for job in queued:
        heapq.heappush(per_user.setdefault(job.owner, []), (-job.priority, job.created_at, job.id, job))

    def head_key(user: str) -> tuple[int, float, float, str]:
        neg_prio, created, job_id, _ = per_user[user][0]
        return (neg_prio, usage.get(user, 0.0), created, job_id)

    decision = Decision()
    reserved: QueuedJob | None = None
    short = (False, False, False)  # what the reserved job is short of: CPUs, GPUs, memory
    while per_user:
        user = min(per_user, key=head_key)
        job = heapq.heappop(per_user[user])[3]
        if not per_user[user]:
            del per_user[user]
        why = (blocked or {}).get(job.id) or _quota_block(job, quotas.get(job.owner, Quotas()),
                                                           held.get(job.owner, Held()))
        if why is None and reserved is not None and any(s and n > 0 for s, n in zip(short, per_worker(job.demand),
                                                                                     strict=True)):
            why = f"behind {named(reserved.id, reserved.owner, job.owner)}, which is next and waiting for room"
        placement = place(job.demand, of_type(free, nodes, job.demand)) if why is None else None
        if why is None and placement is None and (never := never_fits(job.demand, nodes)):
            why = f"cannot fit the cluster as it is now (nodes missing?): {never}"  # waits without reserving
        elif why is None and placement is None:
            why = f"no room: needs {gang_text(job.demand)} at once; {_describe_free(free, job.demand)}{outside}"
            if reserved is None:
                reserved = decision.reserved = job
                short = _short(job.demand, free)
        if why is not None or placement is None:
            decision.order.append((job.id, why or "no room"))
            continue
        for node_id in placement:
            take(free[node_id], job.demand)
        held.setdefault(job.owner, Held()).add(job.demand)
        usage[job.owner] = usage.get(job.owner, 0.0) + weight(job.demand) * start_charge_s
        decision.starts.append((job, placement))
    return decision
