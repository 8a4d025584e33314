"""The scheduling policy's invariants over drawn clusters, queues and quotas (hypothesis): whatever the draw,
``policy.decide`` never hands out more CPUs, GPUs or memory than a node has free, places every worker of a gang
it starts, and never takes a user over a quota."""

from __future__ import annotations

import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from api_schemas.jobs import Demand, Quotas
from service.rules import policy
from service.rules.policy import ActiveJob, Node, QueuedJob

USERS = ("alice", "bob", "carol")

nodes_st = st.lists(st.builds(
    lambda i, cpus, gpus, memory: Node(f"n{i}", cpus=cpus, gpus=gpus, memory_gb=memory),
    st.integers(0, 10**6), st.sampled_from([0, 1, 2, 4, 8]), st.sampled_from([0, 1, 2]),
    st.one_of(st.none(), st.sampled_from([2.0, 8.0, 16.0, 64.0]))), min_size=1, max_size=4,
    unique_by=lambda n: n.id)
# a cluster where memory, not CPUs, runs out first: where a victim's memory must be given back to make room
scarce_memory_st = st.lists(st.builds(
    lambda i, gpus, memory: Node(f"n{i}", cpus=16, gpus=gpus, memory_gb=memory),
    st.integers(0, 10**6), st.sampled_from([0, 2]), st.sampled_from([4.0, 8.0, 16.0])), min_size=1, max_size=3,
    unique_by=lambda n: n.id)
demand_st = st.builds(Demand, workers=st.integers(1, 4), cpus_per_worker=st.sampled_from([0.5, 1, 2, 3]),
                      gpus_per_worker=st.sampled_from([0, 0, 0.25, 0.5, 1]),
                      memory_gb=st.one_of(st.none(), st.sampled_from([0.5, 1.0, 4.0, 10.0])))
queue_st = st.lists(st.tuples(st.sampled_from(USERS), st.integers(-1, 2), demand_st), max_size=12)
quotas_st = st.dictionaries(st.sampled_from(USERS), st.builds(
    Quotas, max_gpus=st.sampled_from([0.5, 1, 8]), max_cpus=st.sampled_from([1, 4, 64]),
    max_running_jobs=st.integers(1, 4), max_memory_gb=st.one_of(st.none(), st.sampled_from([2.0, 12.0]))))


def used(node_id: str, jobs: list[tuple[Demand, list[str] | tuple[str, ...]]]) -> list[float]:
    out = [0.0, 0.0, 0.0]
    for demand, placement in jobs:
        policy.take(out, demand, workers=-sum(1 for p in placement if p == node_id))
    return out


@settings(max_examples=300, deadline=None)
@given(nodes=nodes_st, first=queue_st, second=queue_st, quotas=quotas_st)
def test_decide_never_overcommits_a_node_nor_a_quota(nodes: list[Node], first: list, second: list,
                                                      quotas: dict[str, Quotas]) -> None:
    def queued(items: list, prefix: str) -> list[QueuedJob]:
        return [QueuedJob(f"{prefix}{i}", user, prio, float(i), demand) for i, (user, prio, demand) in
                enumerate(items)]

    # a first round's starts are the running jobs of the second
    d1 = policy.decide(queued(first, "a"), [], nodes, {}, quotas)
    active = [ActiveJob(j.id, j.owner, j.demand, tuple(p)) for j, p in d1.starts]
    d2 = policy.decide(queued(second, "b"), active, nodes, {}, quotas)
    held = [(a.demand, a.placement) for a in active] + [(j.demand, p) for j, p in d2.starts]
    for n in nodes:
        for have, took in zip(n.room(), used(n.id, held), strict=True):
            assert took <= have + 1e-6 or math.isinf(have), (n, held)
    for job, placement in d1.starts + d2.starts:
        assert len(placement) == job.demand.workers and set(placement) <= {n.id for n in nodes}
    for user in USERS:
        mine = [a.demand for a in active if a.owner == user] + [j.demand for j, _ in d2.starts if j.owner == user]
        q = quotas.get(user, Quotas())
        assert len(mine) <= q.max_running_jobs
        assert sum(d.gpus for d in mine) <= q.max_gpus + 1e-6 and sum(d.cpus for d in mine) <= q.max_cpus + 1e-6
        assert q.max_memory_gb is None or sum(d.memory for d in mine) <= q.max_memory_gb + 1e-6
    assert {j.id for j, _ in d2.starts}.isdisjoint(i for i, _ in d2.order)  # a job starts or waits, not both
    assert len(d2.starts) + len(d2.order) == len(second)


@settings(max_examples=300, deadline=None)
@given(nodes=st.one_of(nodes_st, scarce_memory_st), first=queue_st, waiting=demand_st, priority=st.integers(0, 3))
def test_the_victims_chosen_make_room_for_the_whole_gang(nodes: list[Node], first: list, waiting: Demand,
                                                         priority: int) -> None:
    from service.rules import victims as preemption
    from service.rules.victims import Candidate

    d = policy.decide([QueuedJob(f"a{i}", u, p, float(i), dm) for i, (u, p, dm) in enumerate(first)], [], nodes,
                      {}, {})
    active = [ActiveJob(j.id, j.owner, j.demand, tuple(p)) for j, p in d.starts]
    running = [Candidate(a, priority=j.priority, started_at=float(k)) for k, (a, (j, _)) in
               enumerate(zip(active, d.starts, strict=True))]
    free = policy.free_resources(nodes, active)
    assume(policy.place(waiting, free) is None)  # the policy asks for victims only for a gang without room
    plan = preemption.plan(waiting, priority, free, running, [])
    stoppable = {c.id for c in running if c.priority < priority}
    if policy.place(waiting, policy.free_resources(nodes, [a for a in active if a.id not in stoppable])):
        assert plan.victims, plan.note  # stopping every lower-priority job makes room: some are chosen
    if plan.victims:
        assert all(v.priority < priority for v in plan.victims)
        assert policy.place(waiting, preemption.freed(free, [v.job for v in plan.victims])) is not None
        for v in plan.victims:  # the fewest: none of them could stay
            rest = [w.job for w in plan.victims if w is not v]
            assert policy.place(waiting, preemption.freed(free, rest)) is None
