"""Two quota limits: ``max_queued_jobs`` is checked and the job queued in one step (concurrent submits cannot pass
it), and ``max_cpus`` bounds the CPUs of all a user's running jobs at start, as ``max_gpus`` does GPUs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from api_schemas.jobs import Demand, Quotas
from service.rules import policy
from service.rules.policy import ActiveJob, Node, QueuedJob
from tests.service.conftest import Api, tiny

CAP, SUBMITS = 3, 16


def submit_at_once(api: Api, user: str, n: int) -> list[httpx.Response]:
    """``n`` submits by ``user``, each on its own connection, released together."""
    def one(i: int) -> httpx.Response:
        with api.client(user) as c:
            return c.post("/v1/experiments", json={"spec": tiny(), "name": f"burst-{i}"})

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_concurrent_submits_queue_exactly_the_cap(api_only: Api) -> None:
    api_only.add_user("eve", max_queued_jobs=CAP)
    answers = submit_at_once(api_only, "eve", SUBMITS)
    codes = sorted(r.status_code for r in answers)
    assert codes == [201] * CAP + [429] * (SUBMITS - CAP), codes
    refused = next(r for r in answers if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) > 0 and refused.json()["errors"][0]["field"] == "max_queued_jobs"
    with api_only.client("eve") as c:
        queued = c.get("/v1/experiments", params={"state": "queued"}).json()["items"]
        assert len(queued) == CAP
        # a cancel frees a slot at once; an Idempotency-Key replay is no new job, so a full queue still answers it
        key = {"Idempotency-Key": "k1"}
        assert c.post(f"/v1/experiments/{queued[0]['id']}/cancel").status_code == 202
        first = c.post("/v1/experiments", json={"spec": tiny()}, headers=key)
        assert first.status_code == 201
        replay = c.post("/v1/experiments", json={"spec": tiny()}, headers=key)
        assert replay.status_code == 200 and replay.json()["id"] == first.json()["id"]
        assert c.post("/v1/experiments", json={"spec": tiny()}).status_code == 429


def test_admins_are_not_bound_by_the_queued_cap(api_only: Api) -> None:
    with api_only.client() as admin:
        assert admin.patch("/v1/users/admin", json={"quotas": {"max_queued_jobs": 1}}).status_code == 200
    assert [r.status_code for r in submit_at_once(api_only, "admin", 4)] == [201] * 4


def q(job_id: str, owner: str, cpus: float, workers: int = 1) -> QueuedJob:
    return QueuedJob(job_id, owner, 0, float(len(job_id)), Demand(workers=workers, cpus_per_worker=cpus,
                                                                  gpus_per_worker=0))


def test_max_cpus_counts_every_running_job_plus_the_new_one() -> None:
    nodes = [Node("n", cpus=16, gpus=0)]
    running = [ActiveJob("r1", "alice", Demand(workers=2, cpus_per_worker=2, gpus_per_worker=0), ("n", "n"))]
    quotas = {"alice": Quotas(max_cpus=6), "bob": Quotas(max_cpus=6)}
    # alice holds 4 of 6: a 2-CPU job starts, then a 1-CPU one would make 7; bob's own 6 start beside her
    d = policy.decide([q("a1", "alice", 2), q("a22", "alice", 1), q("b1", "bob", 3, workers=2)], running, nodes,
                      {}, quotas)
    assert sorted(j.id for j, _ in d.starts) == ["a1", "b1"]
    assert dict(d.order)["a22"] == "quota: needs 1 CPUs; alice holds 6 of max_cpus=6"
    # once her running job ends, the same queue starts
    d = policy.decide([q("a22", "alice", 1)], [], nodes, {}, quotas)
    assert [j.id for j, _ in d.starts] == ["a22"]
