"""Which running jobs to preempt for a queued job that finds no room: a pure function, no Redis, no Ray.

Only the job that ``policy.decide`` found first without room (``Decision.reserved``: the highest-priority job
that waits for resources, not for a quota or a dependency) may preempt, and only running jobs of STRICTLY lower
priority that are preemptible (``resources.preemptible``, default true). A sweep is one job: it is preempted
whole (Tune restores its trials from their checkpoints), never trial by trial.

The victims are the fewest jobs whose freed resources let the WHOLE gang fit (``policy.place`` on the free
resources plus theirs); among equally few, the set whose highest-ranked victim ranks lowest, where the rank is
lowest priority first, then most recently started (least work to redo). Jobs already on their way out
(preempted earlier, cancelled, at their time limit) count as freed: nothing more is preempted while they stop.
No job is preempted for a gang that would still not fit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from api_schemas.jobs import Demand
from service.rules.policy import ActiveJob, named, place, take

MAX_TRIES = 2000  # sets of victims tried exactly; past that, a greedy choice pruned to a minimal set


@dataclass(frozen=True)
class Candidate:
    """A running job as a possible victim."""

    job: ActiveJob
    priority: int
    started_at: float
    preemptible: bool = True

    @property
    def id(self) -> str:
        return self.job.id


@dataclass
class Plan:
    victims: list[Candidate] = field(default_factory=list)  # to stop now
    note: str = ""  # what preemption does for the waiting job, or why it cannot help (appended to its reason)


def rank(c: Candidate) -> tuple[int, float, str]:
    """Preempted first: lowest priority, then most recently started."""
    return (c.priority, -c.started_at, c.id)


def freed(free: dict[str, list[float]], jobs: list[ActiveJob]) -> dict[str, list[float]]:
    """``free`` with the resources of ``jobs`` given back on their nodes."""
    out = {k: list(v) for k, v in free.items()}
    for job in jobs:
        for node_id in job.placement:
            if node_id in out:
                take(out[node_id], job.demand, workers=-1)
    return out


def _fits(demand: Demand, free: dict[str, list[float]], victims: tuple[Candidate, ...] | list[Candidate]) -> bool:
    return place(demand, freed(free, [v.job for v in victims])) is not None


def _greedy(demand: Demand, free: dict[str, list[float]], ranked: list[Candidate]) -> list[Candidate]:
    """Victims in rank order until the gang fits, then each one not needed dropped (the highest-ranked first)."""
    chosen: list[Candidate] = []
    for c in ranked:
        chosen.append(c)
        if _fits(demand, free, chosen):
            break
    for c in sorted(chosen, key=rank, reverse=True):
        rest = [v for v in chosen if v is not c]
        if _fits(demand, free, rest):
            chosen = rest
    return chosen


def choose_victims(demand: Demand, priority: int, free: dict[str, list[float]], running: list[Candidate],
                   max_tries: int = MAX_TRIES) -> list[Candidate] | None:
    """The victims for a gang of ``demand`` at ``priority`` (module doc), or None when preempting every eligible
    job would still not make room. ``free``: node id -> [CPUs, GPUs, memory GiB] free now
    (``policy.free_resources``)."""
    ranked = sorted((c for c in running if c.preemptible and c.priority < priority), key=rank)
    if not ranked or not _fits(demand, free, ranked):
        return None
    tries = 0
    for k in range(1, len(ranked) + 1):
        best: tuple[int, ...] | None = None
        for combo in itertools.combinations(range(len(ranked)), k):
            tries += 1
            if tries > max_tries:
                return _greedy(demand, free, ranked)
            key = combo[::-1]  # the highest-ranked victim first: the smaller, the better
            if (best is None or key < best) and _fits(demand, free, [ranked[i] for i in combo]):
                best = key
        if best is not None:
            return [ranked[i] for i in sorted(best)]
    return None  # not reached: all of them fit


def describe(victims: list[Candidate], reader: str | None = None) -> str:
    return ", ".join(f"{named(v.id, v.job.owner, reader)} (priority {v.priority})" for v in victims)


def plan(demand: Demand, priority: int, free: dict[str, list[float]], running: list[Candidate],
         stopping: list[ActiveJob], enabled: bool = True, released: dict[str, list[float]] | None = None,
         reader: str | None = None) -> Plan:
    """What to preempt now for the waiting gang. ``running``: the running jobs that are not ``stopping`` (jobs
    already on their way out, whose resources count as freed). ``released``: after a recent preemption, what is
    free once Ray has caught up with it (the ledger's own count): Ray reports a stopped job's resources in use
    for a few seconds more, and that lag must not cost a second victim. ``reader``: the waiting job's owner, to
    whom the note names only their own jobs by id (``policy.named``)."""
    if not enabled:
        return Plan()
    free = freed(free, stopping)
    if stopping and place(demand, free) is not None:
        return Plan(note=f"; waiting for {', '.join(named(j.id, j.owner, reader) for j in stopping)} to checkpoint "
                         "and stop")
    if released is not None and place(demand, freed(released, stopping)) is not None:
        return Plan(note="; waiting for Ray to release what the jobs just preempted held")
    victims = choose_victims(demand, priority, free, running)
    if victims:
        return Plan(victims, f"; preempting {describe(victims, reader)}: waiting for them to checkpoint and stop")
    lower = [c for c in running if c.priority < priority]
    pinned = [named(c.id, c.job.owner, reader) for c in lower if not c.preemptible]
    if pinned:
        return Plan(note=f"; cannot preempt {', '.join(pinned)}: resources.preemptible=false")
    if lower:
        return Plan(note="; preempting every lower-priority job would still not make room")
    return Plan()
