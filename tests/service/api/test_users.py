"""Token lifecycle and user changes over real HTTP on a real Redis: rotation, PATCH, disable, across API processes,
and what a stream opened with a token does when that token is rotated."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from api_schemas import keys
from api_schemas.jobs import Quotas
from service.core.store import hash_token
from service.stack.embedded import Stack
from tests.service.conftest import STATIC_NODES, Api, tiny


def status(api: Api, token: str, path: str = "/v1/me") -> int:
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        return c.get(path).status_code


def test_rotation_refuses_the_old_token_at_once(api_only: Api, redis_server: str) -> None:
    old = api_only.add_user("alice")
    assert status(api_only, old) == 200  # now in this API process's cache
    with api_only.client("alice") as c:
        r = c.post("/v1/users/alice/token")
    assert r.status_code == 200, r.text
    new = r.json()["token"]
    assert new != old and r.json()["user"]["token_rotated_at"]
    assert status(api_only, old) == 401 and status(api_only, new) == 200  # the cache too
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    assert r.get(keys.token(hash_token(old))) is None and r.get(keys.user_token("alice")) == hash_token(new)
    # an admin rotates anyone's; a user only their own; an unknown name is 404
    bob = api_only.add_user("bob")
    assert httpx.post(f"{api_only.url}/v1/users/alice/token", headers={"Authorization": f"Bearer {bob}"}).status_code \
        == 403
    with api_only.client() as admin:
        assert admin.post("/v1/users/nobody/token").status_code == 404
        newer = admin.post("/v1/users/alice/token").json()["token"]
    assert status(api_only, new) == 401 and status(api_only, newer) == 200


def test_patch_changes_quotas_flags_and_disables(api_only: Api) -> None:
    token = api_only.add_user("carol", max_gpus=2)
    with api_only.client() as admin:
        r = admin.patch("/v1/users/carol", json={"quotas": {"max_running_jobs": 7}, "can_submit_code": True})
        assert r.status_code == 200, r.text
        assert r.json()["quotas"]["max_gpus"] == 2 and r.json()["quotas"]["max_running_jobs"] == 7  # merged
        assert r.json()["can_submit_code"] is True
        bad = admin.patch("/v1/users/carol", json={"quotas": {"max_gpus": -1}})
        assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "quotas.max_gpus", bad.text
        bad = admin.patch("/v1/users/carol", json={"quotas": {"nonsense": 1}})
        assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "quotas.nonsense", bad.text
        assert admin.patch("/v1/users/nobody", json={"disabled": True}).status_code == 404
        assert admin.patch("/v1/users/admin", json={"disabled": True}).status_code == 409  # no self lock-out
        with api_only.client("carol") as c:
            assert c.get("/v1/me").json()["quotas"]["max_running_jobs"] == 7  # the cached login was refreshed
            assert c.patch("/v1/users/carol", json={"quotas": {"max_gpus": 100}}).status_code == 403
            assert admin.patch("/v1/users/carol", json={"disabled": True}).status_code == 200
            r = c.get("/v1/me")
            assert r.status_code == 401 and "disabled" in r.json()["detail"]
            assert c.post("/v1/experiments", json={"spec": tiny()}).status_code == 401
            assert c.post("/v1/users/carol/token").status_code == 401  # a disabled user cannot mint a way back
            assert admin.patch("/v1/users/carol", json={"disabled": False}).status_code == 200
            assert c.get("/v1/me").status_code == 200 and status(api_only, token) == 200


@pytest.fixture()
def two_apis(api_only: Api, redis_server: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A second API process on the same Redis: its own token cache."""
    other = Stack(tmp_path / "home2", redis_url=redis_server, ray_address="http://127.0.0.1:9",
                  extra_env={"TLAB_CLUSTER_NODES": STATIC_NODES})
    other.home.mkdir(parents=True)
    other.start_service(("api",))
    try:
        yield api_only, other.url
    finally:
        other.stop()


def test_a_rotation_through_one_api_process_is_seen_by_another(two_apis: tuple[Api, str]) -> None:
    api, second = two_apis
    old = api.add_user("dave")
    headers = {"Authorization": f"Bearer {old}"}
    assert httpx.get(f"{second}/v1/me", headers=headers).status_code == 200  # cached in the second process
    with api.client("dave") as c:
        new = c.post("/v1/users/dave/token").json()["token"]
    assert httpx.get(f"{second}/v1/me", headers=headers).status_code == 401  # not after USER_CACHE_S: now
    assert httpx.get(f"{second}/v1/me", headers={"Authorization": f"Bearer {new}"}).status_code == 200
    with api.client() as admin:
        admin.patch("/v1/users/dave", json={"disabled": True})
    assert httpx.get(f"{second}/v1/me", headers={"Authorization": f"Bearer {new}"}).status_code == 401


def test_a_stream_ends_when_its_token_is_rotated_and_the_reconnect_is_401(api_only: Api) -> None:
    old = api_only.add_user("erin")
    with api_only.client("erin") as c:
        job = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]  # stays queued: no scheduler
        lines: list[str] = []
        ended = threading.Event()

        def read() -> None:
            with httpx.stream("GET", f"{api_only.url}/v1/experiments/{job}/events",
                              headers={"Authorization": f"Bearer {old}"}, timeout=60) as r:
                assert r.status_code == 200
                lines.extend(r.iter_lines())  # returns when the server closes the stream
            ended.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        while not any(line.startswith("event: status") for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ended.is_set()  # open, live, waiting for events
        c.post("/v1/users/erin/token")
        assert ended.wait(30), "the stream opened with a rotated token did not end"
        assert not any(line.startswith("event: end") for line in lines)  # closed, not a finished job
        last = [line.split(": ", 1)[1] for line in lines if line.startswith("id: ")][-1]
        again = httpx.get(f"{api_only.url}/v1/experiments/{job}/events",
                          headers={"Authorization": f"Bearer {old}", "Last-Event-ID": last})
        assert again.status_code == 401


def test_the_queue_shows_other_users_jobs_only_as_positions(api_only: Api, redis_server: str) -> None:
    api_only.add_user("fay")
    api_only.add_user("gus")
    with api_only.client("fay") as fay, api_only.client("gus") as gus, api_only.client() as admin:
        mine = fay.post("/v1/experiments", json={"spec": tiny(), "name": "fay-secret"}).json()["id"]
        theirs = gus.post("/v1/experiments", json={"spec": tiny(), "name": "gus-secret"}).json()["id"]
        r = redis.Redis.from_url(redis_server, decode_responses=True)
        r.hset(keys.queue_view(), mapping={mine: '{"position": 2, "reason": "quota max_gpus"}',
                                           theirs: '{"position": 1, "reason": "gus over quota max_gpus"}'})
        seen = fay.get("/v1/queue")
        assert seen.status_code == 200
        first, second = seen.json()["items"]
        assert (first["position"], first["id"], first["owner"], first["name"], first["pending_reason"]) == \
            (1, None, None, None, None) and first["demand"]["workers"] == 1
        assert (second["id"], second["owner"], second["pending_reason"]) == (mine, "fay", "quota max_gpus")
        assert "gus" not in seen.text and theirs not in seen.text
        assert {e["owner"] for e in admin.get("/v1/queue").json()["items"]} == {"fay", "gus"}


def test_cli_rotate_set_disable_enable_and_bootstrap(api_only: Api, tmp_path: Path) -> None:
    from service.cli.users import QUOTA_OPTIONS
    from tests.service.cli.tlab_process import tlab

    assert set(Quotas.model_fields) <= set(QUOTA_OPTIONS)  # every quota has its option in `users create|set`
    env = {"TLAB_URL": api_only.url, "TLAB_TOKEN": api_only.stack.admin_token, "TLAB_HOME": str(tmp_path),
           "REDIS_URL": api_only.stack.redis_url or ""}
    old = api_only.add_user("hal")
    out = tlab("users", "set", "hal", "--max-gpus", "3", "--can-submit-code", "yes", "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["quotas"]["max_gpus"] == 3 and json.loads(out.stdout)["can_submit_code"]
    assert tlab("users", "set", "hal", env=env).stderr.startswith("error: nothing to change")
    rotated = tlab("users", "rotate", "hal", "--json", env={**env, "TLAB_TOKEN": old})  # a user, for themself
    assert rotated.returncode == 0, rotated.stderr
    new = json.loads(rotated.stdout)["token"]
    assert status(api_only, old) == 401 and status(api_only, new) == 200
    assert tlab("users", "disable", "hal", env=env).returncode == 0
    assert status(api_only, new) == 401 and "disabled" in tlab("users", "list", env=env).stdout
    refused = tlab("me", env={**env, "TLAB_TOKEN": new})
    assert refused.returncode == 1 and "is disabled" in refused.stderr and "Traceback" not in refused.stderr
    assert tlab("users", "enable", "hal", env=env).returncode == 0 and status(api_only, new) == 200
    # bootstrap: weak tokens refused in one line; re-pointing the admin refuses the old admin token
    for weak in ("change-me", "tl_short"):
        out = tlab("admin", "bootstrap", env={**env, "TLAB_ADMIN_TOKEN": weak})
        assert out.returncode == 1 and out.stderr.startswith("error: TLAB_ADMIN_TOKEN is too weak"), out.stderr
        assert out.stderr.count("\n") == 1
    strong = "tl_" + "k" * 40
    assert tlab("admin", "bootstrap", env={**env, "TLAB_ADMIN_TOKEN": strong}).returncode == 0
    assert status(api_only, api_only.stack.admin_token) == 401 and status(api_only, strong) == 200


def test_an_admin_disabling_themself_is_a_state_conflict(api_only: Api) -> None:
    """A valid body the caller's own state refuses: 409 with the error body every other error has."""
    with api_only.client() as c:
        me = c.get("/v1/me").json()["name"]
        r = c.patch(f"/v1/users/{me}", json={"disabled": True})
        assert r.status_code == 409 and r.json()["errors"] == [
            {"field": "disabled", "message": "an admin cannot disable themself: ask another admin"}], r.text
        assert c.get("/v1/me").status_code == 200
