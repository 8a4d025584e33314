"""Several nodes: the service on a Ray head plus worker nodes started as a lab would (`ray start
--address` on this machine, each with its own CPU), a 2-worker gang spread over two nodes, one node killed
mid-run: the job is stopped and queued again, waits saying the cluster lacks the room, and resumes from its
checkpoint on the node that joins next, with every epoch exactly once.

Ray is told to declare a silent node dead within ~2 s (its health checks; the default is ~15-30 s)."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from api_schemas import keys
from service.cli.client import Client
from service.stack.embedded import Stack, free_port, loopback_ray_env
from tests.service.conftest import tiny
from tests.service.scheduler.test_preemption import events, wait_reason
from tests.service.scheduler.test_time_limits import wait_epochs
from tests.service.test_failure_reasons import wait_ended

FAST_NODE_DEATH = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
                   "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3"}
NODE_PORTS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
              "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")


@pytest.fixture()
def one_cpu_head(redis_server: str, tmp_path: Path) -> Iterator[Stack]:
    """API + scheduler + a Ray head of its own with 1 CPU (so a 2-worker gang needs a second node)."""
    s = Stack(tmp_path / "home", redis_url=redis_server, num_cpus=1, tick_s=0.2, joinable=True,
              extra_env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "TLAB_STOP_GRACE_S": "5",
                         "TLAB_MAX_EPOCHS": "100000", **FAST_NODE_DEATH})
    try:
        yield s.start()
    finally:
        for name in [n for n in s.procs if n.startswith("node-")]:
            s.kill(name, signal.SIGINT)  # `ray start --block` stops its node at once on SIGINT
        s.stop()


def add_node(stack: Stack, name: str) -> None:
    """A 1-CPU worker node joining the stack's head (its process group is ``stack.procs[name]``)."""
    ports = {flag: free_port() for flag in (*NODE_PORTS, "dashboard_metrics", "autoscaler_metrics")}
    argv = [str(Path(sys.executable).with_name("ray")), "start", "--address",
            f"127.0.0.1:{stack.ray_ports['--port']}", "--block", "--num-cpus", "1", "--node-ip-address",
            "127.0.0.1", "--disable-usage-stats"]
    argv += [str(x) for flag in NODE_PORTS for x in (flag, ports[flag])]
    env = {k: v for k, v in loopback_ray_env(ports).items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    # (that setting allows no 2nd node); a Ray node's environment, without the service's secrets
    stack._spawn(name, argv, {**env, "TLAB_RAY_HEAD": stack.ray_temp or ""}, ray=True)


def wait_nodes(c: Client, n: int, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(nodes := [node["id"] for node in c.json("GET", "/v1/cluster")["nodes"]]) != n:
        assert time.monotonic() < deadline, f"the scheduler never saw {n} nodes: {nodes}"
        time.sleep(0.2)
    return nodes


@pytest.mark.slow
@pytest.mark.drill
def test_a_node_killed_mid_run_the_gang_waits_then_resumes_every_epoch_once(one_cpu_head: Stack) -> None:
    stack = one_cpu_head
    r = redis.Redis.from_url(stack.redis_url or "", decode_responses=True)
    add_node(stack, "node-1")
    with Client(stack.url, stack.admin_token) as c:
        head_and_one = wait_nodes(c, 2)
        spec = tiny(training={"epochs": 100_000, "max_steps_per_epoch": 1}, resources={"workers": 2})
        job = c.submit(spec, name="spread")["id"]
        wait_epochs(c, job, 3)
        placed = json.loads(r.hget(keys.job(job), "placement") or "[]")
        assert sorted(placed) == sorted(head_and_one), placed  # one worker per node: 1 CPU each

        stack.kill("node-1", signal.SIGKILL)  # the node's raylet and what it started there
        reason = wait_reason(c, job, "cannot fit the cluster as it is now", timeout=120)
        view = c.get(job)
        assert view["state"] == "queued" and view["preemptions"] == 1, view
        assert view["last_preemption"].startswith("the loss of node "), view
        assert "the loss of node" in " ".join(e["message"] for e in events(r, job, "log"))
        seen = max(m["epoch"] for m in events(r, job, "epoch"))

        add_node(stack, "node-2")  # a node joins: the gang fits again and resumes from its checkpoint
        wait_epochs(c, job, seen + 3, timeout=180)
        c.cancel(job)
        assert wait_ended(c, job, timeout=120)["state"] == "cancelled", reason
    epochs = [m["epoch"] for m in events(r, job, "epoch")]
    assert epochs == list(range(len(epochs))), epochs  # every epoch exactly once across the node loss
    starts = events(r, job, "start")
    assert len(starts) == 2 and starts[1]["resumed_from_epoch"] >= 1, starts
