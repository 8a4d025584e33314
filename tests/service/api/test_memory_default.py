"""``TLAB_DEFAULT_MEMORY_GB`` over real HTTP and a real Redis (the API alone): a job whose spec asks no host memory
gets the cluster's default at submit, reserved and held as if asked; one that asks keeps its own; more than the
largest node's memory is refused at once naming the field."""

from __future__ import annotations

import json

import pytest

from tests.service.conftest import Api, tiny

NODES = json.dumps([{"id": "n1", "cpus": 4, "gpus": 0, "memory_gb": 16},
                    {"id": "n2", "cpus": 4, "gpus": 0, "memory_gb": 8}])  # a node not known would not limit


@pytest.fixture()
def api_env() -> dict[str, str]:
    return {"TLAB_DEFAULT_MEMORY_GB": "3", "TLAB_CLUSTER_NODES": NODES}


def test_a_spec_without_memory_gets_the_clusters_default_and_one_with_keeps_its_own(api_only: Api) -> None:
    with api_only.client() as c:
        plain = c.post("/v1/experiments", json={"spec": tiny()}).json()
        assert plain["spec"]["resources"]["memory_gb"] == 3 and plain["demand"]["memory_gb"] == 3
        own = c.post("/v1/experiments", json={"spec": tiny(resources={"memory_gb": 1.5})}).json()
        assert own["spec"]["resources"]["memory_gb"] == 1.5 and own["demand"]["memory_gb"] == 1.5
        sweep = c.post("/v1/sweeps", json={"base": tiny(), "search_space": {"training.seed": {"grid": [0, 1]}}})
        assert sweep.status_code == 201 and sweep.json()["spec"]["resources"]["memory_gb"] == 3, sweep.text
        big = c.post("/v1/experiments", json={"spec": tiny(resources={"memory_gb": 20})})
        assert big.status_code == 422 and big.json()["errors"][0]["field"] == "spec.resources", big.text
        assert ("resources.memory_gb=20 but the largest node has 16.0 GiB of memory Ray can reserve"
                in big.json()["detail"]), big.text


def test_max_memory_gb_refuses_a_gang_over_it_at_submit(api_only: Api) -> None:
    api_only.add_user("alice", max_memory_gb=5)
    with api_only.client("alice") as c:
        over = c.post("/v1/experiments", json={"spec": tiny(resources={"workers": 2, "memory_gb": 3})})
        assert over.status_code == 422 and over.json()["errors"][0]["field"] == "spec.resources.memory_gb", over.text
        assert "the gang needs 6 GiB of memory at once; your max_memory_gb quota is 5" in over.json()["detail"]
        # the cluster's default counts: 3 GiB a worker
        assert c.post("/v1/experiments", json={"spec": tiny()}).status_code == 201
        me = c.get("/v1/me").json()
        assert me["quotas"]["max_memory_gb"] == 5
