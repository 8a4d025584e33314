"""The scheduling policy (pure) and the job state machine on a real Redis: order, quotas, fair share,
gangs, reservations, and a simulated cluster where several users' jobs come and go."""

from __future__ import annotations

import itertools
import math
import signal
import subprocess

import pytest

from api_schemas import keys
from api_schemas.jobs import TERMINAL, TRANSITIONS, Demand, ExperimentSubmit, JobState, Quotas, UserCreate
from service.core.store import Store
from service.rules import policy
from service.rules import victims as preemption
from service.rules.policy import ActiveJob, Node, QueuedJob
from service.rules.victims import Candidate
from tests.service.conftest import tiny

CPU1 = Demand(workers=1, cpus_per_worker=1, gpus_per_worker=0)
_seq = itertools.count()


def q(owner: str, demand: Demand = CPU1, priority: int = 0, at: float | None = None) -> QueuedJob:
    n = next(_seq)
    return QueuedJob(f"j{n:04d}", owner, priority, float(n) if at is None else at, demand)


def order(decision: policy.Decision) -> list[str]:
    return [j.id for j, _ in decision.starts]


def test_priority_then_fair_share_then_age() -> None:
    nodes = [Node("n", cpus=3, gpus=0)]
    a1, a2, b1, c1 = q("alice"), q("alice"), q("bob"), q("carol", priority=5)
    d = policy.decide([a1, a2, b1, c1], [], nodes, usage={"alice": 0.0, "bob": 5.0}, quotas={})
    # carol's priority first; then alice (less usage) before bob; alice's own jobs by age; starting a job
    # charges alice, so bob's job overtakes alice's second one
    assert order(d) == [c1.id, a1.id, b1.id]
    assert d.order == [(a2.id, d.order[0][1])] and d.order[0][1].startswith("no room")


def test_gang_must_fit_whole_on_nodes() -> None:
    nodes = [Node("n1", cpus=2, gpus=1), Node("n2", cpus=2, gpus=1)]
    gang = q("alice", Demand(workers=2, cpus_per_worker=1, gpus_per_worker=1))
    d = policy.decide([gang], [], nodes, {}, {})
    assert sorted(d.starts[0][1]) == ["n1", "n2"]  # one GPU per node: spread over both
    busy = [ActiveJob("x", "bob", Demand(workers=1, cpus_per_worker=1, gpus_per_worker=1), ("n1",))]
    d = policy.decide([gang], busy, nodes, {}, {})
    assert not d.starts and "no room" in d.order[0][1]
    assert policy.never_fits(Demand(workers=3, cpus_per_worker=1, gpus_per_worker=1), nodes)
    assert policy.never_fits(Demand(workers=1, cpus_per_worker=1, gpus_per_worker=2), nodes)
    assert policy.never_fits(gang.demand, nodes) is None


def test_a_gpu_model_is_placed_only_on_nodes_of_that_model_and_never_fits_without_one() -> None:
    nodes = [Node("a", cpus=4, gpus=2, gpu_type="A100"), Node("h", cpus=4, gpus=2, gpu_type="H100")]
    h100 = Demand(workers=2, cpus_per_worker=1, gpus_per_worker=0.5, gpu_type="H100")
    d = policy.decide([q("alice", h100)], [], nodes, {}, {})
    assert d.starts[0][1] == ["h", "h"]  # the A100 node had room first in the packing order, and is skipped
    busy = [ActiveJob("x", "bob", Demand(workers=1, cpus_per_worker=1, gpus_per_worker=2), ("h",))]
    d = policy.decide([q("alice", h100)], busy, nodes, {}, {})
    assert not d.starts and d.order[0][1].startswith("no room")  # the A100s are free, and not its model
    l4 = h100.model_copy(update={"gpu_type": "L4"})
    assert "resources.gpu_type=L4 but no node has that GPU model (the cluster has: A100, H100)" in (
        policy.never_fits(l4, nodes) or "")
    d = policy.decide([q("alice", l4)], [], nodes, {}, {})
    assert d.order[0][1].startswith("cannot fit the cluster as it is now (nodes missing?)")  # waits, as today


def test_the_cluster_view_shows_each_running_jobs_share_of_each_node() -> None:
    from service.scheduler.cluster_view import cluster_view

    nodes = [Node("n1", cpus=4, gpus=2, gpu_type="H100"), Node("n2", cpus=4, gpus=1)]
    gang = ActiveJob("g", "alice", Demand(workers=2, cpus_per_worker=1, gpus_per_worker=0.5), ("n1", "n1"))
    trial = ActiveJob("t", "bob", Demand(workers=2, cpus_per_worker=0.5, gpus_per_worker=0.25), ("n1", "n2"))
    view = cluster_view(nodes, [gang, trial], {"g": (812.5, 700.0), "t": (96.0,)})  # peak GPU MiB per rank reported
    n1, n2 = view.nodes
    assert [(s.job, s.workers, s.cpus, s.gpus) for s in n1.jobs] == [("g", 2, 2.0, 1.0), ("t", 1, 0.5, 0.25)]
    assert [(s.job, s.gpus) for s in n2.jobs] == [("t", 0.25)]
    assert [s.gpu_memory_mb for s in n1.jobs] == [1512.5, 96.0]  # both ranks of g on n1: summed; t: rank 0's
    assert n2.jobs[0].gpu_memory_mb is None  # t's rank 1 is on n2 and only its rank 0 reported
    spread = cluster_view(nodes, [trial], {"t": (96.0, 80.0)}).nodes  # each rank's memory on its own node
    assert [n.jobs[0].gpu_memory_mb for n in spread] == [96.0, 80.0]
    assert (n1.gpus_total, n1.gpus_free, n1.gpu_type, n2.gpus_free, view.gpus_free) == (2, 0.75, "H100", 0.75, 1.5)
    assert view.running_jobs == ["g", "t"]


def test_quotas_skip_a_user_without_blocking_others() -> None:
    nodes = [Node("n", cpus=8, gpus=4)]
    gpu2 = Demand(workers=2, cpus_per_worker=1, gpus_per_worker=1)
    a1, a2, b1 = q("alice", gpu2), q("alice", gpu2), q("bob", CPU1)
    quotas = {"alice": Quotas(max_gpus=3, max_running_jobs=5), "bob": Quotas(max_running_jobs=1)}
    d = policy.decide([a1, a2, b1], [ActiveJob("old", "bob", CPU1, ("n",))], nodes, {}, quotas)
    assert order(d) == [a1.id]
    reasons = dict(d.order)
    assert "max_gpus=3" in reasons[a2.id] and "max_running_jobs=1" in reasons[b1.id]


def test_a_blocked_big_gang_is_not_starved_by_small_jobs() -> None:
    nodes = [Node("n", cpus=4, gpus=2)]
    running = [ActiveJob("r", "bob", Demand(workers=1, cpus_per_worker=1, gpus_per_worker=1), ("n",))]
    big = q("alice", Demand(workers=2, cpus_per_worker=1, gpus_per_worker=1))
    small_gpu, small_cpu = q("bob", Demand(workers=1, cpus_per_worker=1, gpus_per_worker=1)), q("carol", CPU1)
    d = policy.decide([big, small_gpu, small_cpu], running, nodes, {"bob": 5.0, "carol": 5.0}, {})
    # the big gang waits for a GPU and reserves it: the small GPU job waits behind it, the CPU-only job runs
    assert order(d) == [small_cpu.id]
    reasons = dict(d.order)
    assert reasons[big.id].startswith("no room") and "behind another user's job" in reasons[small_gpu.id]
    own = q("alice", Demand(workers=1, cpus_per_worker=1, gpus_per_worker=1))  # one's own job is named
    assert f"behind {big.id}, which" in dict(policy.decide([big, own], running, nodes, {}, {}).order)[own.id]


def test_simulated_cluster_dispatch_is_fair_and_nobody_starves() -> None:
    """3 users flood a 2-slot cluster (alice 30 jobs, bob 10, carol 3); jobs take one round each.
    Dispatches interleave users instead of serving alice's backlog first."""
    nodes = [Node("n1", cpus=1, gpus=0), Node("n2", cpus=1, gpus=0)]
    queued = [q("alice", at=0.0 + i) for i in range(30)] + [q("bob", at=100.0 + i) for i in range(10)] + \
             [q("carol", at=200.0 + i) for i in range(3)]
    usage: dict[str, float] = {}
    started: list[str] = []
    while queued:
        d = policy.decide(queued, [], nodes, usage, {}, start_charge_s=60)
        assert len(d.starts) == 2 or len(queued) < 2
        for job, _ in d.starts:
            started.append(job.owner)
            usage[job.owner] = usage.get(job.owner, 0) + policy.weight(job.demand) * 60
        ids = {j.id for j, _ in d.starts}
        queued = [j for j in queued if j.id not in ids]
    first9 = started[:9]
    assert first9.count("alice") == first9.count("bob") == first9.count("carol") == 3  # round robin
    assert started.index("carol") < 3 and max(i for i, u in enumerate(started) if u == "carol") < 9
    # then alice and bob alternate until bob's 10 are done: bob never waits for alice's whole backlog
    assert started[9:23] == ["alice", "bob"] * 7 or started[9:23] == ["bob", "alice"] * 7
    assert started[23:] == ["alice"] * 20


def test_decayed_usage_lets_a_heavy_user_back_in(redis_server: str) -> None:
    store = Store.from_url(redis_server)
    store.charge({"alice": 100.0, "bob": 10.0}, now=0.0, half_life_s=60)
    assert store.usage(now=0.0, half_life_s=60) == pytest.approx({"alice": 100.0, "bob": 10.0})
    later = store.usage(now=240.0, half_life_s=60)  # 4 half-lives
    assert later["alice"] == pytest.approx(6.25) and later["bob"] == pytest.approx(0.625)
    store.charge({"bob": 10.0}, now=240.0, half_life_s=60)
    assert store.usage(now=240.0, half_life_s=60)["bob"] > later["alice"]  # bob is now the heavier one


def test_transition_table_is_enforced_atomically(redis_server: str) -> None:
    store = Store.from_url(redis_server)
    job = store.submit("alice", ExperimentSubmit(spec=tiny()))[0]
    assert store.r.zscore(keys.queue(), job) is not None
    assert not store.transition(job, JobState.RUNNING)  # queued -> running is not in the table
    assert store.transition(job, JobState.STARTING, expect=[JobState.QUEUED])
    assert store.r.zscore(keys.queue(), job) is None and store.r.sismember(keys.active(), job)
    assert not store.transition(job, JobState.STARTING, expect=[JobState.QUEUED])  # a second scheduler loses
    assert store.transition(job, JobState.RUNNING)
    assert store.transition(job, JobState.SUCCEEDED)
    assert not store.r.sismember(keys.active(), job) and store.r.hget(keys.job(job), "finished_at")
    for to in JobState:  # terminal: nothing moves it again
        assert not store.transition(job, to)
    kinds = [f["kind"] for _, f in store.r.xrange(keys.events(job))]
    assert kinds == ["status"] * 4 + ["end"]
    assert all(not TRANSITIONS[s] for s in TERMINAL)


def test_the_schedulers_wait_outlasts_redis_pys_socket_timeout(redis_server: str) -> None:
    """A tick wait longer than redis-py's 5 s socket timeout returns on a wake (it raised TimeoutError), and
    returns False when none came."""
    import threading

    store = Store.from_url(redis_server)
    store.r.delete(keys.wake())
    assert store.wait_wake(0.3) is False
    assert store.wait_wake(1e-5) is False and store.wait_wake(0.0105) is False  # a BLPOP of 0 ms blocks forever
    timer = threading.Timer(5.5, lambda: store.r.lpush(keys.wake(), "x"))  # the only push: past the 5 s timeout
    timer.start()
    try:
        assert store.wait_wake(30.0) is True  # one 30-s BLPOP raised TimeoutError after 5 s
    finally:
        timer.cancel()
    assert store.r.llen(keys.wake()) == 0


def test_queue_survives_a_redis_restart(tmp_path) -> None:  # noqa: ANN001
    from service.stack.embedded import free_port
    from tests.conftest import start_redis

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"

    def start() -> subprocess.Popen:
        return start_redis(port, tmp_path)

    proc = start()
    store = Store.from_url(url)
    store.create_user(UserCreate(name="alice"))
    ids = [store.submit("alice", ExperimentSubmit(spec=tiny(), priority=i))[0] for i in range(5)]
    store.cancel(ids[0])
    store.r.close()
    proc.send_signal(signal.SIGKILL)  # no clean shutdown: the AOF, fsynced before each reply, must hold it all
    proc.wait()
    proc = start()
    try:
        store = Store.from_url(url)
        assert store.r.zrange(keys.queue(), 0, -1) == ids[1:]
        assert store.view(ids[0]).state == JobState.CANCELLED
        assert store.user("alice") is not None
    finally:
        proc.terminate()
        proc.wait()


def test_a_job_that_no_longer_fits_waits_without_blocking_others() -> None:
    nodes = [Node("n1", cpus=2, gpus=1)]  # its second GPU node is gone
    orphan = q("alice", Demand(workers=2, cpus_per_worker=1, gpus_per_worker=1))
    small = q("bob", Demand(workers=1, cpus_per_worker=1, gpus_per_worker=1))
    d = policy.decide([orphan, small], [], nodes, {}, {})
    assert order(d) == [small.id]
    assert dict(d.order)[orphan.id].startswith("cannot fit the cluster as it is now")


def test_what_ray_reports_in_use_beyond_the_ledger_is_not_handed_out() -> None:
    """Other Ray work on a shared cluster (or a finished job's workers still being released) holds CPUs the
    ledger thinks are free: a gang that needs them waits, saying why, instead of starting and waiting inside
    Ray; a job that fits in what is really free still starts."""
    mine = ActiveJob("mine", "bob", CPU1, ("n",))
    two = q("alice", Demand(workers=2, cpus_per_worker=1, gpus_per_worker=0))
    one = q("carol", CPU1)
    # Ray sees bob's 1 CPU plus 1.5 more: only 1.5 of the ledger's 3 free CPUs are really free
    nodes = [Node("n", cpus=4, gpus=0, cpus_used=2.5, gpus_used=0.0)]
    assert policy.free_resources(nodes, [mine]) == {"n": [1.5, 0.0, math.inf]}  # memory not known: no limit
    assert policy.held_outside(nodes, [mine]) == (1.5, 0.0, 0.0)
    d = policy.decide([two], [mine], nodes, {}, {})
    assert not d.starts
    why = dict(d.order)[two.id]
    assert why.startswith("no room") and "Ray reports 1.5 CPUs, 0 GPUs in use beyond" in why, why
    assert order(policy.decide([one], [mine], nodes, {}, {})) == [one.id]
    # Ray's view lagging behind a job just started (ledger 1 used, Ray 0): the ledger still counts it
    nodes = [Node("n", cpus=4, gpus=0, cpus_used=0.0, gpus_used=0.0)]
    assert policy.free_resources(nodes, [mine]) == {"n": [3.0, 0.0, math.inf]}
    assert policy.held_outside(nodes, [mine]) == (0, 0, 0)
    assert order(policy.decide([two, one], [mine], nodes, {}, {})) == [two.id, one.id]
    # not known (no autoscaler report): the ledger alone, as before
    assert policy.free_resources([Node("n", cpus=4, gpus=0)], [mine]) == {"n": [3.0, 0.0, math.inf]}


# ---- preemption (service.rules.victims): which running jobs make room for a waiting one; pure, no Ray


def cpus(n: float, workers: int = 1) -> Demand:
    return Demand(workers=workers, cpus_per_worker=n, gpus_per_worker=0)


def running(job_id: str, n: float, priority: int = 0, started: float = 0.0, node: str = "n",
            preemptible: bool = True) -> Candidate:
    return Candidate(ActiveJob(job_id, "bob", cpus(n), (node,)), priority, started, preemptible)


def preempted(demand: Demand, priority: int, jobs: list[Candidate], nodes: list[Node] | None = None,
              stopping: tuple[ActiveJob, ...] = (), enabled: bool = True) -> tuple[list[str], str]:
    """(the victims' ids, the note added to the waiting job's reason) on a 4-CPU node unless ``nodes``."""
    nodes = nodes or [Node("n", cpus=4, gpus=0)]
    free = policy.free_resources(nodes, [c.job for c in jobs] + list(stopping))
    plan = preemption.plan(demand, priority, free, jobs, list(stopping), enabled)
    return [v.id for v in plan.victims], plan.note


def test_preemption_takes_the_fewest_victims() -> None:
    jobs = [running("a", 1, started=1), running("b", 1, started=2), running("c", 2, priority=1)]
    # two priority-0 jobs would make room too, but one priority-1 job is fewer
    assert preempted(cpus(2), 5, jobs)[0] == ["c"]
    # a gang over two nodes needs both nodes' jobs: the whole gang must fit
    nodes = [Node("n1", cpus=2, gpus=0), Node("n2", cpus=2, gpus=0)]
    spread = [running("x", 2, node="n1"), running("y", 2, node="n2", started=1)]
    assert sorted(preempted(cpus(2, workers=2), 5, spread, nodes)[0]) == ["x", "y"]


def test_preemption_takes_the_lowest_priority_then_the_most_recent_first() -> None:
    assert preempted(cpus(2), 5, [running("old_p1", 2, priority=1, started=5), running("p0", 2, started=0)])[0] \
        == ["p0"]
    victims, note = preempted(cpus(2), 5, [running("older", 2, started=1), running("newer", 2, started=2)])
    assert victims == ["newer"] and note.startswith("; preempting newer (priority 0)")
    # among equally few, the set whose highest-ranked victim ranks lowest: two priority-0 jobs, not a priority-3 one
    jobs = [running("a", 1, started=3), running("b", 1, started=2), running("p3", 2, priority=3)]
    assert preempted(cpus(2), 5, jobs + [running("d", 0.5, priority=4)], [Node("n", cpus=4.5, gpus=0)])[0] \
        == ["p3"]  # one victim beats two
    assert preempted(cpus(3), 5, jobs)[0] == ["a", "p3"]  # the more recent of the priority-0 jobs


def test_equal_or_higher_priority_is_never_preempted() -> None:
    assert preempted(cpus(4), 5, [running("same", 4, priority=5)]) == ([], "")
    assert preempted(cpus(4), 5, [running("same", 2, priority=5), running("low", 2, priority=0)])[0] == []


def test_no_preemption_for_a_job_that_would_still_not_fit() -> None:
    victims, note = preempted(cpus(4), 5, [running("low", 2), running("high", 2, priority=9)])
    assert victims == [] and "would still not make room" in note
    assert preempted(cpus(8), 5, [running("low", 4)])[0] == []  # more than the whole cluster


def test_non_preemptible_jobs_are_skipped() -> None:
    jobs = [running("pinned", 2, started=9, preemptible=False), running("other", 2, started=1)]
    assert preempted(cpus(2), 5, jobs)[0] == ["other"]
    victims, note = preempted(cpus(2), 5, [running("pinned", 4, preemptible=False)])
    assert victims == [] and note == "; cannot preempt pinned: resources.preemptible=false"


def test_preemption_off_and_jobs_already_stopping() -> None:
    assert preempted(cpus(4), 5, [running("low", 4)], enabled=False) == ([], "")
    # a job already on its way out (preempted earlier, cancelled, at its time limit) counts as freed
    leaving = ActiveJob("leaving", "bob", cpus(2), ("n",))
    victims, note = preempted(cpus(2), 5, [running("low", 2)], stopping=(leaving,))
    assert victims == [] and note == "; waiting for leaving to checkpoint and stop"
    assert preempted(cpus(4), 5, [running("low", 2)], stopping=(leaving,))[0] == ["low"]  # not enough alone


def test_ray_lagging_behind_a_preemption_makes_no_second_victim() -> None:
    """A victim just requeued: the ledger has its CPUs free, Ray still reports them in use for a few seconds."""
    low = running("low", 2)
    nodes = [Node("n", cpus=4, gpus=0, cpus_used=4.0, gpus_used=0.0)]  # low's 2 CPUs + the victim's 2, per Ray
    free = policy.free_resources(nodes, [low.job])
    released = policy.free_resources([Node("n", cpus=4, gpus=0)], [low.job])
    plan = preemption.plan(cpus(2), 5, free, [low], [], released=released)
    assert plan.victims == [] and "waiting for Ray to release" in plan.note
    assert [v.id for v in preemption.plan(cpus(2), 5, free, [low], []).victims] == ["low"]  # no preemption lately


def test_past_the_exact_search_a_greedy_choice_is_still_minimal() -> None:
    jobs = [running("a", 1, started=1), running("b", 1, started=2), running("c", 2, priority=1)]
    free = policy.free_resources([Node("n", cpus=4, gpus=0)], [c.job for c in jobs])
    chosen = preemption.choose_victims(cpus(2), 5, free, jobs, max_tries=0)
    assert chosen is not None and sorted(v.id for v in chosen) == ["a", "b"]  # fits; neither can be dropped


def test_the_first_job_without_room_is_the_one_that_may_preempt() -> None:
    nodes = [Node("n", cpus=2, gpus=0)]
    busy = [ActiveJob("x", "carol", cpus(2), ("n",))]
    capped, big, small = q("carol", cpus(1), priority=9), q("alice", cpus(2), priority=5), q("bob", cpus(1))
    d = policy.decide([capped, big, small], busy, nodes, {}, {"carol": Quotas(max_running_jobs=1)})
    assert d.reserved == big  # carol's job waits for her quota, not for room
    assert policy.decide([], busy, nodes, {}, {}).reserved is None
