"""A node leaving (``tlab leave``): the scheduler starts nothing there, and the jobs placed there are stopped and
queued again with their age, no failure counted, saying the node left; they then start on another node. The real
Scheduler, store, policy and preemption path on a real Redis, ticked at chosen times; the one part not real is Ray's
Jobs API behind the ``Launcher`` seam (``Jobs`` of ``test_fair_share.py``). The same on real hosts and real Ray:
``tests/hosts/test_hosts.py``, a host that leaves mid-run."""

from __future__ import annotations

import json

from api_schemas import keys
from api_schemas.jobs import ExperimentSubmit
from service.cli.stack import alive
from service.core import nodes_leaving
from service.core.settings import Settings
from service.core.store import Store
from service.launch.ray_cluster import StaticCluster
from service.scheduler import preempt as preempting
from service.scheduler.tick import Scheduler
from tests.service.conftest import tiny
from tests.service.scheduler.test_fair_share import Jobs
from tests.service.scheduler.test_preemption import events

NODES = json.dumps([{"id": "n1", "cpus": 1, "hostname": "cpu-1", "address": "10.0.0.11"},
                    {"id": "n2", "cpus": 1, "hostname": "cpu-2", "address": "10.0.0.12"}])


def scheduler(redis_server: str) -> tuple[Store, Scheduler, Jobs]:
    store, ray = Store.from_url(redis_server), Jobs()
    settings = Settings(redis_url=redis_server, cluster_nodes=NODES)
    return store, Scheduler(store, settings, StaticCluster(NODES), ray), ray


def tick(sched: Scheduler, now: float) -> None:
    """One scheduler tick at ``now`` (``Scheduler.tick`` reads the clock)."""
    sched.evict(sched.nodes(), now)
    sched.reconcile(now)
    sched.dispatch(now)


def submit(store: Store, now: float) -> str:
    return store.submit("ann", ExperimentSubmit.model_validate({"spec": tiny()}), now=now)[0]


def placed(store: Store, job: str) -> list[str]:
    return list(json.loads(store.raw(job).get("placement") or "[]"))


def shown(store: Store) -> dict[str, str]:
    """node id -> its ALIVE column in `tlab cluster`, from the published cluster view."""
    return {n["id"]: alive(n) for n in json.loads(store.r.get(keys.cluster()) or "{}")["view"]["nodes"]}


def test_a_leaving_node_takes_no_new_job_until_it_joins_again(redis_server: str) -> None:
    store, sched, _ = scheduler(redis_server)
    first = submit(store, 999.0)
    tick(sched, 1000.0)
    busy = placed(store, first)[0]
    free = "n2" if busy == "n1" else "n1"
    address = {"n1": "10.0.0.11", "n2": "10.0.0.12"}[free]
    nodes_leaving.mark(store.r, "cpu", address, 60.0, 1000.0)
    waiting = submit(store, 1001.0)
    for now in (1002.0, 1003.0):
        tick(sched, now)
    assert store.raw(waiting)["state"] == "queued"  # the only free CPU is on the node leaving
    assert shown(store) == {busy: "yes", free: "LEAVING"}
    nodes_leaving.clear(store.r, address)  # it joined again
    tick(sched, 1004.0)
    assert store.raw(waiting)["state"] == "starting" and placed(store, waiting) == [free]
    assert shown(store) == {busy: "yes", free: "yes"}


def test_the_jobs_on_a_leaving_node_are_requeued_without_a_failure_and_start_elsewhere(redis_server: str) -> None:
    store, sched, ray = scheduler(redis_server)
    job = submit(store, 999.0)
    tick(sched, 1000.0)
    tick(sched, 1001.0)  # Ray runs it
    node = placed(store, job)[0]
    label = {"n1": "cpu-1 (10.0.0.11)", "n2": "cpu-2 (10.0.0.12)"}[node]
    nodes_leaving.mark(store.r, label.split()[0], label.split("(")[1].rstrip(")"), 60.0, 1001.0)

    sched.evict(sched.nodes(), 1002.0)  # stopped as a preempted job is: SIGTERM, its driver exports its checkpoint
    data = store.raw(job)
    assert data[preempting.PREEMPTED_BY] == f"the node {label} leaving" and ray.states[data["ray_job_id"]] == "STOPPED"
    assert data[preempting.PREEMPTED_PRIORITY] == preempting.LEAVING_NODE
    said = [e["message"] for e in events(store.r, job, "log")]
    assert any(m.startswith(f"the node {label} leaving: its admin took it out") for m in said), said

    sched.reconcile(1002.0)  # Ray let it go: queued again with its age
    data = store.raw(job)
    assert data["state"] == "queued" and data["preemptions"] == "1" and preempting.failed_attempts(data) == 0
    assert (data["last_preemption"] or "").startswith(f"the node {label} leaving at ")
    status = [json.loads(f["data"]) for _, f in store.events(job) if f["kind"] == "status"]
    assert status[-1]["reason"] == f"the node {label} leaving: queued again to resume from its last checkpoint"
    sched.dispatch(1002.0)  # and started on the other node
    assert store.raw(job)["state"] == "starting" and placed(store, job) not in ([node], [])
    assert store.raw(job)["attempts"] == "2"
    assert not any("the loss of node" in e["message"] for e in events(store.r, job, "log"))  # nothing was lost
