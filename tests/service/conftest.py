"""Service fixtures: real Redis, a real Ray head (with token auth, as `tlab up` starts it), the real API
and scheduler processes, talked to over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.stack import Stack

# a fixed simulated cluster for the API-only tests: 2 nodes x (4 CPUs, 1 GPU)
STATIC_NODES = json.dumps([{"id": "n1", "cpus": 4, "gpus": 1}, {"id": "n2", "cpus": 4, "gpus": 1}])

TINY = {"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [32]},
        "training": {"epochs": 2, "batch_size": 64}, "teleport": {"enabled": False}}


def tiny(**sections: Any) -> dict[str, Any]:
    spec = json.loads(json.dumps(TINY))
    for k, v in sections.items():
        spec.setdefault(k, {}).update(v)
    return spec


class Api:
    """An HTTP client per user, on one running stack."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.url = stack.url
        self.tokens = {"admin": stack.admin_token}

    def client(self, user: str = "admin", **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.tokens[user]}"} if user in self.tokens else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kw)

    def add_user(self, name: str, **quotas: Any) -> str:
        with self.client() as c:
            r = c.post("/v1/users", json={"name": name, "quotas": quotas} if quotas else {"name": name})
            assert r.status_code == 201, r.text
            self.tokens[name] = r.json()["token"]
        return self.tokens[name]


@pytest.fixture()
def api_only(redis_server: str, tmp_path: Path) -> Iterator[Api]:
    """The API alone (no scheduler, no Ray) on a fixed 2-node cluster: jobs stay queued."""
    stack = Stack(tmp_path / "home", redis_url=redis_server, ray_address="http://127.0.0.1:9",
                  extra_env={"TLAB_CLUSTER_NODES": STATIC_NODES, "TLAB_SSE_HEARTBEAT_S": "0.5"})
    stack.home.mkdir(parents=True)
    stack.ensure_admin()
    stack.start_service(("api",))
    try:
        yield Api(stack)
    finally:
        stack.stop()


@pytest.fixture()
def stack(redis_server: str, ray_head: Stack, tmp_path: Path) -> Iterator[Stack]:
    """API + scheduler on a fresh Redis and the session's Ray head; ticks every 0.2 s."""
    s = Stack(tmp_path / "home", redis_url=redis_server, ray_address=ray_head.ray_address,
              ray_token=ray_head.ray_token, tick_s=0.2,
              extra_env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "TLAB_STOP_GRACE_S": "5",
                         "RAY_AUTH_MODE": "token"})
    s.home.mkdir(parents=True)
    s.ensure_admin()
    s.start_service()
    try:
        yield s
    finally:
        s.stop()

