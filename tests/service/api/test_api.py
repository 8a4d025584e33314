"""The REST API over real HTTP and a real Redis (no scheduler here: jobs stay queued)."""

from __future__ import annotations

import json

import httpx

from api_schemas import keys
from tests.service.conftest import Api, tiny, wait_for


def submit(c: httpx.Client, spec: dict | None = None, **kw: object) -> httpx.Response:
    return c.post("/v1/experiments", json={"spec": spec or tiny(), **kw})


def test_submit_get_list_and_queue(api_only: Api) -> None:
    api_only.add_user("alice", max_priority=3)  # the default quota is 0
    with api_only.client("alice") as c:
        r = submit(c, name="first", tags=["a"], priority=3)
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["state"] == "queued" and job["owner"] == "alice" and job["name"] == "first"
        assert job["demand"] == {"workers": 1, "cpus_per_worker": 1.0, "gpus_per_worker": 0.0, "gpu_type": None,
                                 "memory_gb": None}
        got = c.get(f"/v1/experiments/{job['id']}").json()
        assert got["spec"]["model"]["hidden"] == [32] and got["pending_reason"]
        ids = [submit(c, tags=["b"]).json()["id"] for _ in range(4)]
        page1 = c.get("/v1/experiments", params={"limit": 2}).json()
        assert [j["id"] for j in page1["items"]] == ids[::-1][:2]  # newest first
        page2 = c.get("/v1/experiments", params={"limit": 2, "cursor": page1["next_cursor"]}).json()
        page3 = c.get("/v1/experiments", params={"limit": 2, "cursor": page2["next_cursor"]}).json()
        seen = [j["id"] for p in (page1, page2, page3) for j in p["items"]]
        assert seen == ids[::-1] + [job["id"]] and page3["next_cursor"] is None
        tagged = c.get("/v1/experiments", params={"tag": "a"}).json()["items"]
        assert [j["id"] for j in tagged] == [job["id"]]
        queued = c.get("/v1/experiments", params={"state": "queued", "limit": 500}).json()["items"]
        assert len(queued) == 5
        queue = c.get("/v1/queue").json()["items"]
        assert {q["id"] for q in queue} == set(ids) | {job["id"]}


def test_auth_matrix(api_only: Api) -> None:
    api_only.add_user("alice")
    api_only.add_user("bob")
    with api_only.client("alice") as alice, api_only.client("bob") as bob, api_only.client() as admin, \
            httpx.Client(base_url=api_only.url) as anon:
        job = submit(alice).json()["id"]
        for path in ("/v1/experiments", f"/v1/experiments/{job}", "/v1/queue", "/v1/cluster", "/v1/presets",
                     f"/v1/experiments/{job}/metrics", "/v1/me"):
            assert anon.get(path).status_code == 401, path
            assert anon.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert anon.post("/v1/experiments", json={"spec": tiny()}).status_code == 401
        assert anon.get("/healthz").status_code == 200
        # bob can neither see nor cancel alice's job; a missing job is 404 for everyone
        assert bob.get(f"/v1/experiments/{job}").status_code == 403
        assert bob.post(f"/v1/experiments/{job}/cancel").status_code == 403
        assert bob.get(f"/v1/experiments/{job}/events").status_code == 403
        assert bob.get("/v1/experiments", params={"owner": "alice"}).status_code == 403
        assert bob.get("/v1/experiments").json()["items"] == []
        assert bob.get("/v1/experiments/nope").status_code == 404
        assert admin.get(f"/v1/experiments/{job}").status_code == 200
        assert [j["id"] for j in admin.get("/v1/experiments", params={"owner": "alice"}).json()["items"]] == [job]
        # only admins manage users; names are unique
        assert bob.post("/v1/users", json={"name": "eve"}).status_code == 403
        assert bob.get("/v1/users").status_code == 403
        assert admin.post("/v1/users", json={"name": "alice"}).status_code == 409
        assert {u["name"] for u in admin.get("/v1/users").json()} == {"admin", "alice", "bob"}
        assert admin.post(f"/v1/experiments/{job}/cancel").status_code == 202


def test_tokens_are_stored_hashed(api_only: Api, redis_server: str) -> None:
    import redis

    token = api_only.add_user("carol")
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    dump = json.dumps({k: r.dump(k).hex() if r.type(k) != "none" else "" for k in r.keys("*")})
    assert token not in dump and token.encode().hex() not in dump


def test_bad_specs_name_the_field(api_only: Api) -> None:
    with api_only.client() as c:
        r = submit(c, tiny(teleport={"enabled": True, "tau": 1.5}))
        assert r.status_code == 422 and "spec.teleport.tau" in r.json()["detail"], r.text
        r = submit(c, tiny(training={"epochs": 2, "nonsense": 1}))
        assert r.status_code == 422 and "spec.training.nonsense" in r.json()["detail"]
        r = c.post("/v1/experiments", json={"spec": tiny(), "priority": 1000})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "priority"
        r = c.post("/v1/experiments", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 422


def test_gang_that_can_never_fit_is_refused_and_dry_run_says_where(api_only: Api) -> None:
    with api_only.client() as c:
        r = submit(c, tiny(resources={"workers": 3, "gpus_per_worker": 1}))  # 2 nodes x 1 GPU
        assert r.status_code == 422 and "spec.resources" in r.json()["detail"] and "GPUs" in r.json()["detail"]
        r = submit(c, tiny(resources={"workers": 1, "cpus_per_worker": 6}))
        assert r.status_code == 422 and "cpus_per_worker" in r.json()["detail"]
        r = c.post("/v1/experiments", params={"dry_run": "true"},
                   json={"spec": tiny(resources={"workers": 2, "gpus_per_worker": 1})})
        assert r.status_code == 200 and r.json()["fits_ever"] and sorted(r.json()["placement"]) == ["n1", "n2"]
        r = c.post("/v1/experiments", params={"dry_run": "true"},
                   json={"spec": tiny(resources={"workers": 4, "gpus_per_worker": 1})})
        assert r.status_code == 200 and not r.json()["fits_ever"] and "workers" in r.json()["reason"]
        assert c.get("/v1/experiments").json()["items"] == []  # dry runs queue nothing


def test_idempotent_submit(api_only: Api) -> None:
    with api_only.client() as c:
        h = {"Idempotency-Key": "k1"}
        first = c.post("/v1/experiments", json={"spec": tiny(), "name": "x"}, headers=h)
        again = c.post("/v1/experiments", json={"spec": tiny(), "name": "x"}, headers=h)
        assert first.status_code == 201 and again.status_code == 200
        assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
        other = c.post("/v1/experiments", json={"spec": tiny(), "name": "y"}, headers=h)
        assert other.status_code == 409 and "Idempotency-Key" in other.json()["detail"]
        assert len(c.get("/v1/experiments").json()["items"]) == 1


def test_cancel_queued_job_ends_its_stream(api_only: Api, redis_server: str) -> None:
    import redis

    with api_only.client() as c:
        job = submit(c).json()["id"]
        r = c.post(f"/v1/experiments/{job}/cancel")
        assert r.status_code == 202 and r.json()["state"] == "cancelled"
        assert c.post(f"/v1/experiments/{job}/cancel").status_code == 409  # terminal states never change
        text = c.get(f"/v1/experiments/{job}/events").text  # a finished job's stream: history, then it closes
        kinds = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
        assert kinds == ["status", "status", "end"]
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    assert r.zcard(keys.queue()) == 0 and r.hget(keys.job(job), "state") == "cancelled"


def test_health_metrics_presets_cluster(api_only: Api) -> None:
    with api_only.client() as c:
        assert c.get("/readyz").status_code == 503  # no scheduler in this fixture
        assert "spec" in c.get("/v1/presets").json()["digits/teleport"]
        assert c.get("/v1/cluster").json()["scheduler_alive"] is False
        submit(c)
        text = c.get("/metrics").text
        assert "tlab_submissions_total 1.0" in text and "tlab_queue_length 1" in text
        # requests are counted per full route template (a router's prefix included), not per concrete path
        assert 'tlab_http_requests_total{method="POST",route="/v1/experiments",status="201"} 1.0' in text
        assert c.get("/v1/me").json()["role"] == "admin"


def test_sse_of_a_waiting_job_sends_heartbeats_through_proxies(api_only: Api) -> None:
    with api_only.client() as c:
        job = submit(c).json()["id"]
        with c.stream("GET", f"/v1/experiments/{job}/events") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache"
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith(": keep-alive"):
                    break
        assert "event: status" in lines and lines[-1] == ": keep-alive"  # history first, then a heartbeat
        bad = c.get(f"/v1/experiments/{job}/events", headers={"Last-Event-ID": "not-an-id"})
        assert bad.status_code == 422 and "Last-Event-ID" in bad.json()["detail"]


def test_the_cluster_shows_another_users_running_job_without_its_id(api_only: Api) -> None:
    """The view the scheduler published (written here as it writes it) holds alice's and bob's running jobs: alice
    sees her own id and bob's share of the node without his; an admin sees both ids."""
    import time

    import redis

    from api_schemas.jobs import ClusterView, NodeShare, NodeView

    api_only.add_user("alice")
    api_only.add_user("bob")
    ids = {}
    for user in ("alice", "bob"):
        with api_only.client(user) as c:
            ids[user] = submit(c).json()["id"]
    shares = [NodeShare(job=ids[u], workers=1, cpus=1, gpus=0) for u in ("alice", "bob")]
    view = ClusterView(nodes=[NodeView(id="n1", alive=True, cpus_total=4, cpus_free=2, gpus_total=0, gpus_free=0,
                                       jobs=shares)], cpus_total=4, cpus_free=2, gpus_total=0, gpus_free=0,
                       running_jobs=[ids["alice"], ids["bob"]], scheduler_alive=True)
    r = redis.Redis.from_url(api_only.stack.redis_url or "")
    r.set(keys.cluster(), json.dumps({"view": view.model_dump(mode="json"), "at": time.time()}))
    with api_only.client("alice") as c:  # the API re-reads the published view at most every 0.5 s
        wait_for(lambda: bool(c.get("/v1/cluster").json()["running_jobs"]), 10, "the API never read the view")
        seen = c.get("/v1/cluster").json()
    assert seen["running_jobs"] == [ids["alice"]] and ids["bob"] not in json.dumps(seen), seen
    assert [(s["job"], s["cpus"]) for s in seen["nodes"][0]["jobs"]] == [(ids["alice"], 1), (None, 1)]
    with api_only.client() as c:
        assert c.get("/v1/cluster").json()["running_jobs"] == [ids["alice"], ids["bob"]]
