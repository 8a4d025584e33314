"""Service fixtures: real Redis, a real Ray head (with token auth, as `tlab up` starts it), the real API
and scheduler processes, talked to over real HTTP."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.stack.embedded import Stack

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
def api_env() -> dict[str, str]:
    """More environment for ``api_only``'s API: a test module overrides this fixture to set its own."""
    return {}


@pytest.fixture()
def api_only(redis_server: str, tmp_path: Path, api_env: dict[str, str]) -> Iterator[Api]:
    """The API alone (no scheduler, no Ray) on a fixed 2-node cluster: jobs stay queued."""
    stack = Stack(tmp_path / "home", redis_url=redis_server, ray_address="http://127.0.0.1:9",
                  extra_env={"TLAB_CLUSTER_NODES": STATIC_NODES, "TLAB_SSE_HEARTBEAT_S": "0.5", **api_env})
    stack.home.mkdir(parents=True)
    stack.ensure_admin()
    stack.start_service(("api",))
    try:
        yield Api(stack)
    finally:
        stack.stop()


@pytest.fixture()
def stack_env() -> dict[str, str]:
    """More environment for ``stack``'s API and scheduler: a test module overrides this fixture to set its own."""
    return {}


@pytest.fixture()
def stack(redis_server: str, ray_head: Stack, tmp_path: Path, stack_env: dict[str, str]) -> Iterator[Stack]:
    """API + scheduler on a fresh Redis and the session's Ray head; ticks every 0.2 s."""
    s = Stack(tmp_path / "home", redis_url=redis_server, ray_address=ray_head.ray_address,
              ray_token=ray_head.ray_token, tick_s=0.2,
              extra_env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "TLAB_STOP_GRACE_S": "5",
                         "RAY_AUTH_MODE": "token",
                         # tests that cancel a running job submit one of 100_000 epochs (the default cap is 1000)
                         "TLAB_MAX_EPOCHS": "100000", **stack_env})
    s.home.mkdir(parents=True)
    s.ensure_admin()
    s.start_service()
    try:
        yield s
    finally:
        s.stop()


def ray_rest(stack: Stack) -> httpx.Client:
    """An HTTP client for the head's dashboard (Jobs and State REST APIs) that sends the cluster's token."""
    headers = {"Authorization": f"Bearer {stack.ray_token}"} if stack.ray_token else {}
    return httpx.Client(base_url=stack.ray_address or "", headers=headers, timeout=60)


def ray_state(http: httpx.Client, resource: str) -> list[dict]:
    """Every record of one kind (``actors``, ``placement_groups``, ...) from the head's State API, in detail."""
    body = http.get(f"/api/v0/{resource}", params={"limit": 10_000, "detail": "true"}).raise_for_status()
    assert body.json()["result"], body.text  # the State API's own failure
    return body.json()["data"]["result"]["result"]


def ray_jobs(stack: Stack) -> list[dict]:
    """Every Ray job the head knows (its Jobs REST API, with the cluster's token), as Ray's JobDetails dicts."""
    with ray_rest(stack) as http:
        return http.get("/api/jobs/").raise_for_status().json()


def ray_holders(stack: Stack) -> dict[str, list[dict]]:
    """What holds the Ray cluster's CPUs now, as Ray itself sees it: unfinished Ray jobs, alive actors that
    take CPU, and placement groups not removed (the head's Jobs and State REST APIs, with the cluster's token:
    what ``JobSubmissionClient`` and ``ray.util.state`` ask, without importing Ray into a process of its own)."""
    with ray_rest(stack) as http:
        listed = functools.partial(ray_state, http)
        jobs = [{"id": j["submission_id"], "status": j["status"], "tlab_job": (j.get("metadata") or {}).get("tlab_job")}
                for j in ray_jobs(stack) if j["status"] in ("PENDING", "RUNNING")]
        actors = [{"class": a["class_name"], "pid": a.get("pid"), "resources": a.get("required_resources"),
                   "job": a.get("job_id"), "placement_group": a.get("placement_group_id")}
                  for a in listed("actors")
                  if a["state"] == "ALIVE" and (a.get("required_resources") or {}).get("CPU", 0) > 0]
        groups = [{"id": g["placement_group_id"], "state": g["state"], "creator_job": g.get("creator_job_id"),
                   "bundles": [b.get("unit_resources") for b in g.get("bundles") or []]}
                  for g in listed("placement_groups") if g["state"] in ("PENDING", "CREATED", "RESCHEDULING")]
    return {"ray_jobs": jobs, "cpu_actors": actors, "placement_groups": groups}


def wait_for(ok: Callable[[], bool], timeout_s: float, what: str | Callable[[], str] = "timed out") -> None:
    """Block until ``ok()``; fails with ``what`` after ``timeout_s`` (a callable: asked then, to say the state)."""
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.2)


def wait_ray_idle(stack: Stack, timeout_s: float = 120.0) -> None:
    """Block until nothing holds the Ray cluster's CPUs (an earlier test's jobs, actors and placement groups
    all gone): a test that needs the whole 2-CPU head must not start beside leftovers. Fails naming them."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        held = ray_holders(stack)
        if not any(held.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the Ray head is still busy after {timeout_s:g} s: {json.dumps(held)}")
        time.sleep(1.0)


def closed_checkout() -> Path | None:
    """The first directory above this checkout's environment that other users cannot pass (a clone under /root,
    0700), or None. A root ``tlab up`` runs Ray as its service user, which must import the project from there: with
    such a checkout the tests run ``tlab up`` with ``TLAB_SERVICE_USER=off`` and the service user's own test skips,
    naming the directory."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    return next((p for p in [*reversed(site.parents), site] if not os.stat(p).st_mode & 0o001), None)


def service_user_env() -> dict[str, str]:
    """``tlab up``'s environment for the tests: the service user off where it could not run the project."""
    return {"TLAB_SERVICE_USER": "off"} if os.geteuid() == 0 and closed_checkout() is not None else {}


@contextmanager
def tlab_up(home: Path, *args: str, timeout_s: float = 180) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """``tlab up ARGS`` on its own Redis and Ray (REDIS_URL/RAY_ADDRESS unset), as a user starts it: yields the
    process, the URL it printed, and what it printed; stops it with Ctrl-C (SIGINT) on the way out."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(TLAB_HOME=str(home), **service_user_env())
    proc = subprocess.Popen([str(Path(sys.executable).parent / "tlab"), "up", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url, printed = "", []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not url:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line and proc.poll() is not None:  # it exited (a refusal at start): no URL will come
                break
            printed.append(line)
            if line.startswith("Teleport Lab is up at "):
                url = line.split()[-1]
        assert url, f"tlab up never printed its URL (exit status {proc.poll()}): {''.join(printed)[-2000:]}"
        yield proc, url, printed
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
        if proc.stdout:
            proc.stdout.close()
