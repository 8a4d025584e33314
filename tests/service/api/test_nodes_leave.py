"""``/v1/nodes/leave`` (``tlab leave``) over real HTTP on a real Redis (the API alone: what the scheduler does with a
leaving node is ``tests/service/scheduler/test_leaving_nodes.py``, and on real hosts ``tests/hosts``): only the join
token not revoked that a node joined with may take it out, and asking is no join; another token joins nothing from
its address, nor from the head's; the answer lists the jobs still placed on the node; a node joining again from that
address clears its leave; a revoked token's addresses are free again."""

from __future__ import annotations

import json

import httpx
import pytest
import redis

from api_schemas import keys
from api_schemas.jobs import ClusterView, ExperimentSubmit, JobState, NodeView
from service.core import join_tokens
from service.core.errors import InvalidState
from service.core.store import Store
from tests.service.conftest import Api, tiny

NODE = {"hostname": "gpu-3", "address": "10.0.0.13"}


@pytest.fixture()
def api_env() -> dict[str, str]:
    return {"TLAB_JOIN_ADDRESS": "10.0.0.1:6380"}  # the service lets nodes join (tlab up --listen)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def running_on(store: Store, node_id: str) -> str:
    """A running job placed on ``node_id`` (as the scheduler leaves one)."""
    job, *_ = store.submit("admin", ExperimentSubmit.model_validate({"spec": tiny()}), now=100.0)
    assert store.transition(job, JobState.STARTING, expect=[JobState.QUEUED], attempts="1", now=101.0,
                            placement=json.dumps([node_id]))
    assert store.transition(job, JobState.RUNNING, started_at="102.0", now=102.0)
    return job


def publish(r: redis.Redis, nodes: list[NodeView]) -> None:
    """The scheduler's view of the cluster, with these nodes."""
    view = ClusterView(nodes=nodes, cpus_total=0, cpus_free=0, gpus_total=0, gpus_free=0, running_jobs=[],
                       scheduler_alive=True)
    r.set(keys.cluster(), json.dumps({"view": view.model_dump(), "at": 100.0}))


def test_only_a_join_token_takes_a_node_out_and_the_answer_lists_its_jobs(api_only: Api, redis_server: str) -> None:
    store = Store.from_url(redis_server)
    user = api_only.add_user("ann")
    with api_only.client() as admin:
        made = admin.post("/v1/join-tokens", json={"note": "nodes"}).json()
        secret = made["secret"]
        revoked = admin.post("/v1/join-tokens", json={"note": "to revoke"}).json()
        assert admin.delete(f"/v1/join-tokens/{revoked['token']['id']}").status_code == 204
        with httpx.Client(base_url=api_only.url, timeout=30) as c:
            for headers in ({}, bearer("tlj_0123456789ab.wrong"), bearer(revoked["secret"]), bearer(user),
                            bearer(api_only.tokens["admin"])):  # a user's token, even an admin's, is no join token
                assert c.post("/v1/nodes/leave", json=NODE, headers=headers).status_code == 401, headers
                assert c.get("/v1/nodes/leave", params={"address": NODE["address"]},
                             headers=headers).status_code == 401, headers
            assert store.r.hgetall(keys.nodes_leaving()) == {}  # nothing recorded by a refusal
            refused = c.post("/v1/nodes/leave", json=NODE, headers=bearer(secret))
            assert refused.status_code == 403 and refused.json()["errors"][0]["field"] == "address"  # none joined
            assert c.post("/v1/nodes/join", json=NODE, headers=bearer(secret)).status_code == 200  # the node joins

            ours = running_on(store, "f" * 56)
            running_on(store, "e" * 56)  # on another node
            head = {"hostname": "cpu-1", "address": "10.0.0.11"}  # as the head's node: joined with no join token
            publish(store.r, [NodeView(id="f" * 56, alive=True, cpus_total=1, cpus_free=0, gpus_total=0, gpus_free=0,
                                       **NODE),
                              NodeView(id="e" * 56, alive=True, cpus_total=1, cpus_free=0, gpus_total=0, gpus_free=0,
                                       **head)])
            # another machine's join token takes nothing of this node's, nor the head's: no leave, no question about
            # its leave, no join from its address (which would clear a leave)
            other = admin.post("/v1/join-tokens", json={"note": "another machine"}).json()["secret"]
            assert c.post("/v1/nodes/leave", json=NODE, headers=bearer(other)).status_code == 403
            assert c.post("/v1/nodes/leave", json=head, headers=bearer(other)).status_code == 403
            assert c.get("/v1/nodes/leave", params={"address": NODE["address"]},
                         headers=bearer(other)).status_code == 403
            gcs = {"hostname": "head", "address": "10.0.0.1"}  # the Ray head's own address (TLAB_JOIN_ADDRESS)
            for taken in (NODE, head, gcs):
                r = c.post("/v1/nodes/join", json=taken, headers=bearer(other))
                assert r.status_code == 409 and r.json()["errors"][0]["field"] == "address", r.text
            assert store.r.hgetall(keys.nodes_leaving()) == {}
            bad = c.post("/v1/nodes/leave", json={**NODE, "wait_s": "60"}, headers=bearer(secret))
            assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "wait_s"
            r = c.post("/v1/nodes/leave", json={**NODE, "wait_s": 60}, headers=bearer(secret))
            assert r.status_code == 200, r.text
            left = r.json()
            assert (left["hostname"], left["address"], left["jobs"]) == ("gpu-3", "10.0.0.13", [ours])
            assert left["until"] >= left["since"] + 60
            assert list(store.r.hgetall(keys.nodes_leaving())) == ["10.0.0.13"]
            assert "10.0.0.13" in store.r.lrange(keys.wake(), 0, -1)  # the scheduler acts at once
            again = c.post("/v1/nodes/leave", json=NODE, headers=bearer(secret)).json()
            assert again["since"] == left["since"]  # asked again: the same leave

            def ask(address: str) -> httpx.Response:
                return c.get("/v1/nodes/leave", params={"address": address}, headers=bearer(secret))

            assert ask("10.0.0.13").status_code == 200 and ask("10.0.0.13").json()["jobs"] == [ours]
            assert store.transition(ours, JobState.QUEUED, expect=[JobState.RUNNING], now=110.0)  # moved
            assert ask("10.0.0.13").json()["jobs"] == []
            assert ask("10.0.0.11").status_code == 403 and ask("10.0.0.13;x").status_code == 422  # not its node

            assert c.post("/v1/nodes/join", json=NODE, headers=bearer(secret)).status_code == 200  # back
            assert ask("10.0.0.13").status_code == 404
            tokens = {t["note"]: t["joins"] for t in admin.get("/v1/join-tokens").json()}
            assert tokens == {"nodes": 2, "another machine": 0}  # the joins counted; refusals, leaves, questions not

            # the token revoked: its node's address is free for another token's machine, and it takes nothing out
            assert admin.delete(f"/v1/join-tokens/{made['token']['id']}").status_code == 204
            assert c.post("/v1/nodes/leave", json=NODE, headers=bearer(secret)).status_code == 401
            assert c.post("/v1/nodes/join", json=NODE, headers=bearer(other)).status_code == 409  # its node is alive
            publish(store.r, [NodeView(id="f" * 56, alive=False, cpus_total=1, cpus_free=0, gpus_total=0, gpus_free=0,
                                       **NODE)])  # its `tlab join` stopped
            assert c.post("/v1/nodes/join", json=NODE, headers=bearer(other)).status_code == 200
            assert c.post("/v1/nodes/leave", json=NODE, headers=bearer(other)).status_code == 200


def test_a_join_token_binds_so_many_addresses_at_most(redis_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    r = Store.from_url(redis_server).r
    r.delete(keys.nodes_joined())
    monkeypatch.setattr(join_tokens, "MAX_ADDRESSES", 2)
    for address in ("10.0.0.21", "10.0.0.22", "10.0.0.21"):  # the last: joining again from its own address
        join_tokens.bind(r, address, "t1")
    with pytest.raises(InvalidState, match="joined 2 addresses already") as third:  # refused, nothing kept
        join_tokens.bind(r, "10.0.0.23", "t1")
    with pytest.raises(InvalidState, match="with join token t1") as taken:  # another token's
        join_tokens.bind(r, "10.0.0.21", "t2")
    assert third.value.field == taken.value.field == "address"
    join_tokens.bind(r, "10.0.0.23", "t2")
    assert join_tokens.revoke(r, "t1") is False  # (no such token row here) yet its addresses are freed
    assert r.hgetall(keys.nodes_joined()) == {"10.0.0.23": "t2"}
