"""Fair share across a preemption: the owner of a preempted job pays one start charge and the seconds
its gang was held, never a second start charge nor the time it waited in the queue. The real Scheduler, store,
policy and preemption on a real Redis, ticked at chosen times; the one part not real is Ray's Jobs API behind the
scheduler's ``Launcher`` seam (``Jobs`` below). The same on real Ray: ``test_preemption.py``."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from api_schemas.jobs import Demand, ExperimentSubmit, JobState
from service.core.settings import Settings
from service.core.store import Store
from service.launch.ray_cluster import RayJobs, StaticCluster
from service.rules.policy import CPU_WEIGHT
from service.scheduler.tick import Scheduler
from tests.service.conftest import tiny

NODES = json.dumps([{"id": "n", "cpus": 2, "gpus": 0}])
BOTH_CPUS = tiny(resources={"cpus_per_worker": 2})  # each job needs the whole node
W = 2 * CPU_WEIGHT  # its gang's usage per second
START = 60.0  # TLAB_START_CHARGE_S


class Jobs:
    """Ray's Jobs API as the scheduler sees it: a submission is accepted (or refused once, as a Ray that is
    restarting does), runs until stopped, and ends when the test says."""

    submission_id = staticmethod(RayJobs.submission_id)

    def __init__(self) -> None:
        self.states: dict[str, str] = {}
        self.refuse: set[str] = set()

    def submit(self, job_id: str, submission_id: str, module: str = "workers.run", demand: Demand | None = None,
               placement: Sequence[str] = ()) -> None:
        if submission_id in self.refuse:
            self.refuse.discard(submission_id)
            raise RuntimeError("connection refused")
        self.states.setdefault(submission_id, "RUNNING")

    def status(self, submission_id: str) -> str | None:
        return self.states.get(submission_id)

    def message(self, submission_id: str) -> str:
        return ""

    def exit_code(self, submission_id: str) -> int | None:
        return None

    def stop(self, submission_id: str) -> None:
        self.states[submission_id] = "STOPPED"


def tick(sched: Scheduler, now: float) -> None:
    """One scheduler tick at ``now`` (``Scheduler.tick`` reads the clock)."""
    sched.reconcile(now)
    sched.dispatch(now)


def test_a_preempted_job_pays_one_start_charge_and_only_the_time_it_held_its_gang(redis_server: str) -> None:
    store = Store.from_url(redis_server)
    settings = Settings(redis_url=redis_server, cluster_nodes=NODES, TLAB_FAIRSHARE_HALF_LIFE_S=1e12,
                        TLAB_START_CHARGE_S=START)  # a half-life long enough that the sums are exact
    ray = Jobs()
    sched = Scheduler(store, settings, StaticCluster(NODES), ray)
    sched.last_charge = 1000.0

    def usage() -> dict[str, float]:  # as of the last tick
        return store.usage(sched.last_charge, settings.half_life_s)

    a = store.submit("ann", ExperimentSubmit.model_validate({"spec": BOTH_CPUS}), now=999.0)[0]
    tick(sched, 1000.0)  # A starts: one start charge
    assert usage() == pytest.approx({"ann": W * START})
    tick(sched, 1001.0)  # Ray runs it
    assert store.raw(a)["state"] == "running"
    b = store.submit("bob", ExperimentSubmit.model_validate({"spec": BOTH_CPUS, "priority": 5}), now=1005.0)[0]
    tick(sched, 1010.0)  # B finds no room: A is preempted (stopped; Ray reports it gone by the next tick)
    tick(sched, 1020.0)  # A goes back to the queue after holding its gang 20 s; B starts
    assert (store.raw(a)["state"], store.raw(b)["state"]) == ("queued", "starting")
    assert usage() == pytest.approx({"ann": W * (START + 20), "bob": W * START})

    ray.states[RayJobs.submission_id(b, 1)] = "SUCCEEDED"
    ray.refuse.add(RayJobs.submission_id(a, 2))
    tick(sched, 1050.0)  # B ended after 30 s; A's restart is refused once by Ray: it stays queued, still owed free
    assert store.raw(a)["state"] == "queued"
    tick(sched, 1060.0)  # A starts again: no second start charge, nothing for the 40 s it waited
    assert usage() == pytest.approx({"ann": W * (START + 20), "bob": W * (START + 30)})
    tick(sched, 1061.0)
    ray.states[RayJobs.submission_id(a, 2)] = "SUCCEEDED"
    tick(sched, 1075.0)  # A ends after 15 s more
    tick(sched, 1100.0)  # nothing runs: nobody pays
    data = store.raw(a)
    assert (data["state"], data["preemptions"], data["attempts"], data["ran_s"]) == ("succeeded", "1", "2", "19.0")
    assert usage() == pytest.approx({"ann": W * (START + 20 + 15), "bob": W * (START + 30)})
    assert store.view(a).state == JobState.SUCCEEDED
