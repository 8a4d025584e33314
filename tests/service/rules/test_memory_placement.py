"""Host memory as the scheduler's third resource (``service.rules.policy``): a gang's ``resources.memory_gb`` per
worker against Ray's ``memory`` resource on each node, so a job Ray could not reserve memory for waits in the queue
saying so (before, it started and sat in Ray as ``starting`` until TLAB_STARTING_TIMEOUT_S failed it). Pure: no
Redis, no Ray (the real cluster's memory is read in ``tests/service/launch/test_ray_cluster.py``)."""

from __future__ import annotations

import itertools

from api_schemas.jobs import Demand
from service.launch.ray_cluster import StaticCluster, Used
from service.rules import policy
from service.rules import victims as preemption
from service.rules.policy import ActiveJob, Node, QueuedJob
from service.rules.victims import Candidate
from service.scheduler.cluster_view import cluster_view

_seq = itertools.count()


def mem(gb: float | None, workers: int = 1, cpus: float = 1) -> Demand:
    return Demand(workers=workers, cpus_per_worker=cpus, gpus_per_worker=0, memory_gb=gb)


def q(demand: Demand, owner: str = "alice") -> QueuedJob:
    n = next(_seq)
    return QueuedJob(f"q{n:04d}", owner, 0, float(n), demand)


def starts(d: policy.Decision) -> list[tuple[str, list[str]]]:
    return [(j.id, where) for j, where in d.starts]


def test_a_gang_whose_memory_ray_cannot_reserve_now_waits_saying_so() -> None:
    nodes = [Node("n", cpus=8, gpus=0, memory_gb=16.0)]
    a, b = q(mem(10)), q(mem(10), owner="bob")
    d = policy.decide([a, b], [], nodes, {}, {})
    assert starts(d) == [(a.id, ["n"])]  # CPUs for both; memory for one
    assert dict(d.order)[b.id] == ("no room: needs 1 x (1 CPU, 0 GPU, 10 GiB) at once; 7 CPUs, 0 GPUs, 6.0 GiB of "
                                   "memory free on 1 node(s)")
    # b is short of memory only: a job that asks none still starts; one that asks some waits behind b
    none, some = q(mem(None), owner="carol"), q(mem(1), owner="dan")
    d = policy.decide([b, none, some], [ActiveJob(a.id, "alice", a.demand, ("n",))], nodes, {}, {})
    assert starts(d) == [(none.id, ["n"])]
    assert dict(d.order)[some.id] == "behind another user's job, which is next and waiting for room"  # b is bob's


def test_workers_go_to_the_nodes_with_memory_for_them() -> None:
    nodes = [Node("small", cpus=8, gpus=0, memory_gb=4.0), Node("big", cpus=8, gpus=0, memory_gb=32.0)]
    d = policy.decide([q(mem(6, workers=3))], [], nodes, {}, {})
    assert starts(d)[0][1] == ["big"] * 3  # 18 GiB on the big node; the small one could take none of them
    assert starts(policy.decide([q(mem(3, workers=2))], [], nodes, {}, {}))[0][1] == ["small", "big"]


def test_memory_no_node_has_never_fits_and_unknown_memory_is_no_limit() -> None:
    nodes = [Node("a", cpus=8, gpus=0, memory_gb=16.0), Node("b", cpus=8, gpus=0, memory_gb=12.5)]
    assert policy.never_fits(mem(20), nodes) == ("resources.memory_gb=20 but the largest node has 16.0 GiB of memory "
                                                  "Ray can reserve: lower memory_gb (and raise workers)")
    assert policy.never_fits(mem(10, workers=3), nodes) == (  # each fits a node; 30 GiB in all does not
        "resources: 3 workers x (1 CPU, 0 GPU, 10 GiB) = 3 CPUs, 0 GPUs, 30 GiB; the whole cluster has 16 CPUs, 0 "
        "GPUs, 28.5 GiB: lower resources.workers")
    assert policy.never_fits(mem(10, workers=2), nodes) is None
    unknown = [Node("u", cpus=8, gpus=0)]  # a static cluster without memory_gb, or a Ray without the resource
    assert policy.never_fits(mem(500), unknown) is None
    assert len(policy.decide([q(mem(500)), q(mem(500))], [], unknown, {}, {}).starts) == 2


def test_ray_reporting_memory_reserved_beyond_the_ledger_is_not_handed_out() -> None:
    """Other Ray work (or a job's actors still being released) holding the node's memory: Ray's report caps what
    the ledger would hand out, as for CPUs."""
    nodes = [Node("n", cpus=8, gpus=0, memory_gb=16.0, cpus_used=0.0, gpus_used=0.0, memory_used_gb=12.0)]
    assert policy.free_resources(nodes, []) == {"n": [8.0, 0.0, 4.0]}
    d = policy.decide([q(mem(6))], [], nodes, {}, {})
    assert not d.starts and "4.0 GiB of memory free" in d.order[0][1]
    assert policy.held_outside(nodes, []) == (0.0, 0.0, 12.0)
    assert "(Ray reports 0 CPUs, 0 GPUs, 12.0 GiB in use beyond Teleport Lab's running jobs" in d.order[0][1]
    assert cluster_view(nodes, []).memory_gb_outside == 12.0
    assert policy.held_outside([Node("u", cpus=8, gpus=0, cpus_used=0.0, gpus_used=0.0)], []) == (0, 0, 0)
    tokens = [Node("n", cpus=8, gpus=0, memory_gb=16.0, cpus_used=0.0, gpus_used=0.0, memory_used_gb=4 / 1024)]
    assert policy.held_outside(tokens, []) == (0, 0, 0)  # four trial drivers' 1-MiB tokens: not reported


def test_preempting_a_job_gives_back_its_memory() -> None:
    nodes = [Node("n", cpus=8, gpus=0, memory_gb=16.0)]
    low = Candidate(ActiveJob("low", "bob", mem(12), ("n",)), priority=0, started_at=0.0)
    free = policy.free_resources(nodes, [low.job])
    assert free == {"n": [7.0, 0.0, 4.0]}
    plan = preemption.plan(mem(8), 5, free, [low], [])
    assert [v.id for v in plan.victims] == ["low"]  # CPUs were free: only its memory makes room


def test_the_cluster_view_and_a_static_cluster_carry_memory() -> None:
    static = StaticCluster('[{"id": "n1", "cpus": 4, "gpus": 0, "memory_gb": 16}, {"id": "n2", "cpus": 4}]')
    n1, n2 = static.nodes()
    assert (n1.memory_gb, n2.memory_gb) == (16.0, None)
    view = cluster_view([n1, n2], [ActiveJob("j", "alice", mem(1.5, workers=2), ("n1", "n1"))])
    assert (view.nodes[0].memory_gb_total, view.nodes[0].memory_gb_free) == (16.0, 13.0)
    assert view.nodes[0].jobs[0].memory_gb == 3.0
    assert (view.nodes[1].memory_gb_total, view.nodes[1].memory_gb_free) == (None, None)
    assert (view.memory_gb_total, view.memory_gb_free) == (16.0, 13.0)  # the node whose memory is known
    assert cluster_view([n2], []).memory_gb_total is None


def test_rays_usage_report_gives_memory_in_gib() -> None:
    gib = 2.0**30
    used = Used.of({"CPU": [1.0, 2.0], "memory": [2 * gib, 16 * gib], "objectStoreMemory": [0.0, 7 * gib]})
    assert used == Used(cpus=1.0, gpus=0.0, memory_gb=2.0)
    assert Used.of({"CPU": [0.0, 2.0]}).memory_gb is None  # no memory resource reported: not known


def test_a_dry_run_weighs_memory_against_the_schedulers_view() -> None:
    from service.api.enqueue import dry_run_view, known_nodes

    nodes = [Node("n1", cpus=4, gpus=0, memory_gb=16.0)]
    view = cluster_view(nodes, [ActiveJob("j", "bob", mem(12), ("n1",))])
    assert known_nodes("", view)[0].memory_gb == 16.0  # what a submit's never-fits check weighs
    later = dry_run_view(mem(8), view, known_nodes("", view))
    assert (later.fits_ever, later.fits_now, later.reason) == (True, False, "no room now: it would wait in the queue")
    assert dry_run_view(mem(4), view, known_nodes("", view)).placement == ["n1"]
    never = dry_run_view(mem(20), view, known_nodes("", view))
    assert not never.fits_ever and "resources.memory_gb=20 but the largest node has 16.0 GiB" in (never.reason or "")


def test_max_memory_gb_counts_every_running_job_plus_the_new_one() -> None:
    from api_schemas.jobs import Quotas

    nodes = [Node("n", cpus=16, gpus=0, memory_gb=64.0)]
    running = [ActiveJob("r", "alice", mem(4, workers=2), ("n", "n"))]  # 8 GiB held
    fits, over, other = q(mem(2), owner="alice"), q(mem(2, workers=2), owner="alice"), q(mem(12), owner="bob")
    quotas = {"alice": Quotas(max_memory_gb=10), "bob": Quotas(max_memory_gb=12)}
    d = policy.decide([fits, over, other], running, nodes, {}, quotas)
    assert sorted(j for j, _ in starts(d)) == sorted([fits.id, other.id])
    assert dict(d.order)[over.id] == "quota: needs 4 GiB; alice holds 10 of max_memory_gb=10"
    assert len(policy.decide([over], [], nodes, {}, quotas).starts) == 1  # her running jobs gone: it starts
    assert len(policy.decide([q(mem(None, workers=8), owner="alice")], running, nodes, {}, quotas).starts) == 1


def test_a_sweep_reserves_per_trial_the_most_its_resources_axes_draw() -> None:
    """A trial with a ``resources.*`` axis runs a TorchTrainer of its own values: the scheduler's gang for the sweep
    must cover the largest (before, it counted the base's: a trial drawing 8 GiB or 2 CPUs held more in Ray than
    the ledger had, and waited inside Ray)."""
    from api_schemas.sweeps import SweepSubmit
    from service.core.store import demand_of

    def sweep(space: dict, **base: object) -> SweepSubmit:
        return SweepSubmit.model_validate({"base": {"resources": base}, "search_space": space,
                                           "max_concurrent_trials": 2})

    wide = sweep({"resources.memory_gb": {"grid": [1, 8]}, "resources.cpus_per_worker": {"uniform": [0.5, 2]},
                  "resources.workers": {"randint": [1, 4]}, "optimizer.lr": {"loguniform": [1e-3, 1e-1]}},
                 memory_gb=2)
    assert demand_of(wide) == Demand(workers=3 * 2, cpus_per_worker=2, gpus_per_worker=0, memory_gb=8)
    assert demand_of(sweep({"optimizer.lr": {"grid": [0.1, 0.2]}}, memory_gb=2)).memory_gb == 2  # the base's
    # a choice of no memory or some: the most is some; of none at all: none
    assert demand_of(sweep({"resources.memory_gb": {"choice": [None, 4]}})).memory_gb == 4
    assert demand_of(sweep({"resources.memory_gb": {"choice": [None]}}, memory_gb=2)).memory_gb is None


def test_reserved_memory_is_charged_in_fair_share() -> None:
    """A job holding a node's memory with one CPU is charged for it: 64 GiB weigh as much as a GPU."""
    assert policy.weight(mem(None)) == 0.125 and policy.weight(mem(64)) == 1.125
    assert policy.weight(mem(8, workers=2)) == 2 * 0.125 + 16 / 64
    nodes = [Node("n", cpus=8, gpus=0, memory_gb=256.0)]
    big, small = q(mem(64), owner="alice"), q(mem(None), owner="bob")
    d = policy.decide([big, small, q(mem(None), owner="alice"), q(mem(None), owner="bob")], [], nodes, {}, {},
                      start_charge_s=60)
    # alice's 64-GiB start charged her 9 times bob's: bob's second job goes before her second
    assert [j.owner for j, _ in d.starts] == ["alice", "bob", "bob", "alice"]


def test_a_preflight_in_flight_holds_its_jobs_memory_in_the_policys_view(redis_server: str) -> None:
    from service.core.settings import Settings
    from service.core.store import Store
    from service.scheduler.preflight import Preflights

    flights = Preflights(Store.from_url(redis_server), Settings(redis_url=redis_server), None, None, None)
    flights.held = {"p": ("n", 6.0)}
    node = Node("n", cpus=8, gpus=0, memory_gb=16.0, cpus_used=1.0, gpus_used=0.0, memory_used_gb=6.0)
    (held,) = flights.hold([node])
    assert (held.cpus, held.cpus_used, held.memory_gb, held.memory_used_gb) == (7.0, 0.0, 10.0, 0.0)
    # a gang that would have fitted beside the preflight's CPU alone waits for its memory
    assert not policy.decide([q(mem(12))], [], [held], {}, {}).starts
