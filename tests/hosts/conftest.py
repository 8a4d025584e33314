"""A lab of real hosts on this machine (``tests.hosts.netns``): the serving host runs ``tlab up --listen`` on the
bridge's address with the bucket (moto's S3 server) beside it; each other host joins with ``tlab join`` and nothing
but a join token. One lab per test module: its hosts, its head and its bucket are shared by the module's tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.hosts.netns import Host, Lab
from tests.s3 import CREDENTIALS, make_bucket, moto_server
from tests.service.conftest import service_user_env

TLAB = str(Path(sys.executable).parent / "tlab")
NODE_HOME = "/tmp/tlab-node"  # on the host's own /tmp: its node folder and storage cache are its own


@dataclass
class Head:
    """The serving host's ``tlab up --listen``: its URL, admin token, Redis, and the hosts' ``tlab join``s."""

    url: str
    admin: str
    redis: redis.Redis
    logs: Path
    bucket: str = ""  # the TLAB_STORAGE URI: the durable copy a job resumes from
    up: int = 0  # ``tlab up``'s process id (in this namespace: the serving host's)
    joins: dict[str, subprocess.Popen] = field(default_factory=dict)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin}"}, timeout=30)

    def join_token(self) -> str:
        """A join token as the admin prints it (``tlab join-token``)."""
        out = subprocess.run([TLAB, "--url", self.url, "--token", self.admin, "join-token", "--note", "test hosts"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def join(self, host: Host, token: str) -> None:
        """``tlab join`` on ``host`` with a 1-CPU node, given nothing but the join token (and a PATH)."""
        env = {"PATH": os.environ["PATH"], "TLAB_JOIN_TOKEN": token, "TLAB_HOME": NODE_HOME, "HOME": "/tmp",
               **service_user_env()}
        self.joins[host.name] = host.run([TLAB, "join", self.url, "--num-cpus", "1"], env,
                                         self.logs / f"join-{host.name}.log")

    def nodes(self) -> list[dict[str, Any]]:
        with self.client() as c:
            return list(c.get("/v1/cluster").raise_for_status().json()["nodes"])

    def wait_alive(self, hosts: list[Host], timeout: float = 300) -> dict[str, str]:
        """Until each host's node is alive in the cluster view: host name -> its node id."""
        deadline = time.monotonic() + timeout
        while True:
            alive = {n["hostname"]: n["id"] for n in self.nodes() if n["alive"]}
            if all(h.hostname in alive for h in hosts):
                return {h.hostname: alive[h.hostname] for h in hosts}
            assert time.monotonic() < deadline, f"hosts never alive: {alive}; " + "; ".join(
                self.said(h) for h in hosts if h.hostname not in alive)
            time.sleep(0.5)

    def said(self, host: Host) -> str:
        """What a host's node said: its ``tlab join``'s output, its Ray node's log, its raylet's last lines, and what
        the head's GCS said of its address (a failure's only record: the lab's files go with it)."""
        def tail(path: Path, n: int = 800) -> str:
            try:
                return path.read_text(errors="replace")[-n:]
            except OSError as err:
                return f"({err})"

        def written(path: Path) -> float:
            try:
                return path.stat().st_mtime
            except OSError:  # a stack of another run, just removed
                return 0.0

        pid = host.init_pid() if host.init and host.init.poll() is None else None
        parts = [f"{host.name}: join: {tail(self.logs / f'join-{host.name}.log', 3000)}", host.network()]
        if pid is not None:  # the host's own /tmp, through its init's root
            root = Path(f"/proc/{pid}/root")
            parts.append(f"ray.log: {tail(root / NODE_HOME.lstrip('/') / 'logs' / 'ray.log')}")
            # session_* itself: session_latest links to a path in the host's /tmp, which is not ours
            parts += [f"{p}: {tail(p)}" for p in sorted((root / "tmp").glob("tln*/session_2*/logs/raylet.out"))]
        heads = sorted(Path("/tmp").glob("tlr*/session_latest/logs/gcs_server.out"), key=written)
        for gcs in heads[-1:]:  # the lab's head: the GCS that wrote last
            lines = [ln for ln in tail(gcs, 400_000).splitlines() if host.address in ln]
            parts.append(f"{gcs} on {host.address}: " + "\n".join(lines[-8:]))
        return "\n".join(parts)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    the_lab = Lab(tmp_path_factory.mktemp("hosts"))
    try:
        yield the_lab
    finally:
        the_lab.close()


@pytest.fixture(scope="module")
def bucket(lab: Lab) -> Iterator[str]:
    """A fresh bucket on an S3 server on the serving host's address: the durable copy every host reads."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = moto_server(lab.gateway)
    host, port = server.get_host_and_port()
    name = f"tlab-{uuid.uuid4().hex[:12]}"
    make_bucket(f"{host}:{port}", name)
    try:
        yield f"s3://{name}/lab?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    finally:
        server.stop()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def drain(proc: subprocess.Popen, to: Path) -> None:
    """Copy what ``tlab up`` prints from now on to a file (a pipe nobody reads would block it)."""
    with to.open("a") as out:
        for line in proc.stdout or ():
            out.write(line)


@pytest.fixture(scope="module")
def head(lab: Lab, bucket: str) -> Iterator[Head]:
    """``tlab up --listen <bridge address> --num-cpus 0`` (every job runs on a joined host), the bucket as storage;
    its home where a root ``tlab up``'s service user can pass (not under pytest's 0700 temp root)."""
    home = Path(tempfile.mkdtemp(prefix="tlhead", dir="/tmp"))
    home.chmod(0o711)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(TLAB_HOME=str(home / "home"), TLAB_STORAGE=bucket, TLAB_STORAGE_CACHE=str(home / "cache"),
               TLAB_TICK_S="0.2", TLAB_STOP_GRACE_S="5", TLAB_MAX_EPOCHS="100000",
               RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.1", **CREDENTIALS, **service_user_env(),
               # the hosts share one kernel, so the service user's threads on every host count against each payload's
               # RLIMIT_NPROC, while each host's /proc shows its own only (on real machines the default holds)
               TLAB_SANDBOX_MAX_PROCS="65536")
    with (home / "up.log").open("w") as err:
        proc = subprocess.Popen([TLAB, "up", "--listen", lab.gateway, "--num-cpus", "0"], env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    reader: threading.Thread | None = None
    try:
        url, printed = "", []
        deadline = time.monotonic() + 240
        while not url and time.monotonic() < deadline:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line:  # it closed its output: it is stopping (a refusal at start)
                proc.wait(timeout=90)
                break
            printed.append(line)
            url = line.split()[-1] if line.startswith("Teleport Lab is up at ") else ""
        assert url.startswith(f"http://{lab.gateway}:"), f"tlab up printed {printed}; {(home / 'up.log').read_text()}"
        admin = (home / "home" / "admin.token").read_text().strip()
        password = (home / "home" / "redis.password").read_text().strip()
        said = proc.stdout.readline() if proc.stdout else ""  # "  redis redis://:***@ADDR:PORT/0   ray ..."
        port = said.split()[1].rsplit(":", 1)[1].split("/")[0]
        reader = threading.Thread(target=drain, args=(proc, home / "up.out"), daemon=True)
        reader.start()
        r = redis.Redis.from_url(f"redis://:{password}@{lab.gateway}:{port}/0", decode_responses=True)
        the_head = Head(url=url, admin=admin, redis=r, logs=home, bucket=bucket, up=proc.pid)
        deadline = time.monotonic() + 240  # the head's own node seen alive: Ray is up (a busy machine restarts it)
        while not any(n["alive"] for n in the_head.nodes()):
            assert time.monotonic() < deadline, "the head's Ray never came up: " + "; ".join(
                f"{name}: {(home / 'home' / 'logs' / name).read_text()[-800:]}" for name in ("ray.log", "scheduler.log")
            )
            time.sleep(1)
        yield the_head
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
        if reader is not None:
            reader.join(timeout=10)  # it ends with tlab up's output
        if proc.stdout:
            proc.stdout.close()
        shutil.rmtree(home, ignore_errors=True)
