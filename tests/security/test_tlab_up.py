"""A real ``tlab up`` (one for the module), checked as an attacker on the same network or machine would.

- Redis asks for a password, no server of the stack listens beyond loopback, what it keeps under TLAB_HOME is the
  owner's only (as root: the home passable, the storage the service user's, the default data root readable by its
  group), and a job's code finds no service secret in its environment (it reaches Redis only as its own ACL user).
- Under a root ``tlab up`` no Ray process of the stack is root: while a job with a user's code runs, the test reads
  ``/proc/<pid>/status`` on the host for every process of the stack's Ray head (its tree, and every process whose
  environment holds ``TLAB_RAY_HEAD=<its temp dir>``: daemons, workers, the job's supervisor) and every payload
  (``workers.payload`` in its command line). None has uid 0 (real, effective, saved or file-system). Redis, the API
  and the scheduler are excepted: they stay root, run no job code and hold the secrets, which stay root's 0600
  (checked with ``os.stat``). The job runs on the service user's Python (its ``sys.executable``, printed by the job,
  is not under ``/root``) and succeeds.

Both look at one stack, as starting one is most of either test's time; it stops with Ctrl-C at the module's end,
and must exit cleanly."""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import stat
import subprocess
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from service.cli.client import Client
from service.cli.code_zip import upload
from service.core.sandbox_state import probe
from service.core.settings import Settings
from service.stack.embedded import HEAD_MARK
from tests.service.conftest import closed_checkout, service_user_env, tiny, tlab_up
from tests.service.stack.conftest import passable_home
from tests.service.test_code_packages import wait_end

pytestmark = pytest.mark.slow
ROOT_UP = pytest.mark.skipif(
    os.geteuid() != 0 or bool(probe()) or closed_checkout() is not None,
    reason="the service user is a root tlab up's, with the sandbox on, from a checkout other users can read")

# a user's model factory that reports what its process inherited, and who it is in Redis with each URL it finds
PROBE = '''
import json, os
import redis
from torch import nn
from workers.job.ticket import job_redis_url


def whoami(url):
    try:
        return redis.Redis.from_url(url, decode_responses=True).execute_command("ACL", "WHOAMI")
    except redis.RedisError as err:
        return f"{type(err).__name__}: {err}"


def build():
    env = dict(os.environ)
    print("PROBE " + json.dumps({"env": env, "own": whoami(job_redis_url()) if job_redis_url() else None,
                                 "inherited": whoami(env["REDIS_URL"]) if env.get("REDIS_URL") else None}), flush=True)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
'''
SERVICE_ONLY = ("REDIS_URL", "REDIS_PASSWORD", "TLAB_ADMIN_TOKEN", "TLAB_HOME")


# a model factory that says where it runs, then holds the job for a while so the test can look at its processes
SLOW = '''
import sys, time
from torch import nn


def build(hold_s):
    print("RUNTIME " + sys.executable, flush=True)
    time.sleep(hold_s)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
'''
SECRETS = ("admin.token", "redis.password", "ray.token", "redis.conf")
CONTROL = ("redis-server", "service.api", "service.scheduler")  # root's, by design (the module's docstring)


def listening(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``procs``."""
    out = []
    for p in procs:
        try:
            out += [(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return out


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def uids(pid: int) -> list[int]:
    """Real, effective, saved and file-system uid of ``pid`` (``/proc/<pid>/status``)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:"))
    return [int(u) for u in line.split()[1:]]


def snapshot(up_pid: int) -> dict[int, tuple[str, list[int]]]:
    """Every process of the stack: pid -> (command line, uids)."""
    tree = psutil.Process(up_pid).children(recursive=True)
    marks = {m for p in tree if (m := environ(p).get(HEAD_MARK))}
    assert marks, "no process of the stack carries the Ray head's mark"
    found: dict[int, tuple[str, list[int]]] = {}
    for p in psutil.process_iter():
        try:
            line = " ".join(p.cmdline())
            if p in tree or environ(p).get(HEAD_MARK) in marks or ("workers.payload" in line and any(
                    environ(a).get(HEAD_MARK) in marks for a in p.parents())):  # (a sandbox clears the payload's env)
                found[p.pid] = (line, uids(p.pid))
        except (psutil.NoSuchProcess, FileNotFoundError, StopIteration):
            continue
    return found


def environ(p: psutil.Process) -> dict[str, str]:
    try:
        return p.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


@dataclass
class Up:
    home: Path
    proc: subprocess.Popen[str]
    url: str
    printed: list[str]


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    """One ``tlab up --num-cpus 2`` for the module's tests, in a home a root ``tlab up``'s service user can pass."""
    with passable_home() as home, tlab_up(home, "--num-cpus", "2") as (proc, url, printed):
        yield Up(home, proc, url, printed)
    assert proc.returncode == 0  # Ctrl-C stopped it cleanly


def test_tlab_up_keeps_redis_ray_and_its_files_private(up: Up) -> None:
    home, proc, url, printed = up.home, up.proc, up.url, up.printed
    password = (home / "redis.password").read_text().strip()
    assert password not in "".join(printed + [proc.stdout.readline() if proc.stdout else ""])
    token = (home / "admin.token").read_text().strip()
    deadline = time.monotonic() + 60  # the scheduler reached Redis with the password, and Ray
    while time.monotonic() < deadline and httpx.get(f"{url}/readyz", timeout=10).status_code != 200:
        time.sleep(0.3)
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    assert "sandbox: on (bubblewrap: each job's code sees its own job only)\n" in printed  # said at start
    assert httpx.get(f"{url}/v1/me", headers={"Authorization": f"Bearer {token}"}).status_code == 200

    sockets = listening(psutil.Process(proc.pid).children(recursive=True))
    assert len(sockets) >= 8  # redis, API, GCS, raylet, dashboard, its agent, ... (all found)
    exposed = [s for s in sockets if not is_loopback(s[1])]
    assert exposed == [], f"listening beyond loopback: {exposed}"

    redis_port = next(port for name, _ip, port in sockets if name.startswith("redis"))
    with pytest.raises(redis.AuthenticationError):  # NOAUTH: nothing without the password
        redis.Redis(host="127.0.0.1", port=redis_port).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=redis_port, password="wrong").ping()
    service = redis.Redis(host="127.0.0.1", port=redis_port, password=password, decode_responses=True)
    assert service.ping()
    # a cap on its memory that never evicts the service's keys (TLAB_REDIS_MAXMEMORY_MB, default 1024)
    limits = service.config_get("maxmemory*")
    assert (limits["maxmemory"], limits["maxmemory-policy"]) == (str(1024 << 20), "noeviction"), limits
    service.close()

    for name in ("admin.token", "redis.password", "redis.conf", "api.url"):
        assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
    # as root: passable to the service user's storage (its own, 0700), the default data root its group's
    opened = {home: 0o711, home / "data": 0o2750} if os.geteuid() == 0 and not service_user_env() else {}
    shared = [str(p) for p in [home, *home.rglob("*")]
              if p.stat().st_mode & 0o077 and stat.S_IMODE(p.stat().st_mode) != opened.get(p)]
    assert shared == [], f"readable by others under TLAB_HOME: {shared}"
    job = job_environment(url, token, home / "pkg")
    # in its sandbox it holds no Redis login at all: its records go through its supervisor (workers.payload)
    assert job["own"] is None and job["inherited"] is None, job
    assert not [k for k in SERVICE_ONLY if k in job["env"]], sorted(job["env"])
    held = [k for k, v in job["env"].items() if password in v or token in v]
    assert held == [], f"the job's environment holds the service's secrets in {held}"


@ROOT_UP
def test_no_ray_worker_supervisor_or_payload_is_root_under_a_root_tlab_up(up: Up, tmp_path: Path) -> None:
    home, proc, url, printed = up.home, up.proc, up.url, up.printed
    user = pwd.getpwnam(Settings().service_user)  # made by tlab up when it was missing
    pkg = tmp_path / "pkg" / "slow"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(textwrap.dedent(SLOW))
    token = (home / "admin.token").read_text().strip()
    with Client(url, token) as c:
        spec = {**tiny(training={"epochs": 1}), "code": {"package": upload(c, str(pkg.parent))["package"]},
                "model": {"kind": "custom", "factory": "slow.model:build", "args": {"hold_s": 12}}}
        job = c.submit(spec, name="held")["id"]
        seen = held_processes(proc.pid)
        view = wait_end(c, job)
        assert view["state"] == "succeeded", view.get("failure_reason")
        runtime = next(x for x in c.logs(job).splitlines() if x.startswith("RUNTIME ")).split()[1]
    rooted = {pid: line for pid, (line, ids) in seen.items()
              if 0 in ids and not any(part in line for part in CONTROL)}
    assert rooted == {}, "root processes of the stack's Ray and jobs:\n" + "\n".join(
        f"{pid}: {line[:160]}" for pid, line in rooted.items())
    assert any(line.startswith(f"ray: runs as the service user {user.pw_name} (uid {user.pw_uid})")
               for line in printed), printed  # said at start
    for name in SECRETS:  # the service's own, not the service user's
        st = os.stat(home / name)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600), name
    storage = os.stat(home / "storage")
    assert (storage.st_uid, stat.S_IMODE(storage.st_mode)) == (user.pw_uid, 0o700)
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o711  # passable to its storage, not listable
    assert not runtime.startswith("/root/"), runtime  # the service user's Python, not pyenv's under /root
    assert [line for line, ids in seen.values() if " -m workers.run " in f"{line} "
            and line.split()[0] == runtime], seen  # the supervisor runs it too


def job_environment(url: str, token: str, pkg: Path) -> dict:
    """Run ``PROBE`` as a job of the stack at ``url``: what it printed, with its ``job`` id."""
    (pkg / "probe").mkdir(parents=True)
    (pkg / "probe" / "__init__.py").write_text("")
    (pkg / "probe" / "model.py").write_text(textwrap.dedent(PROBE))
    with Client(url, token) as c:
        spec = {**tiny(training={"epochs": 1}), "model": {"kind": "custom", "factory": "probe.model:build"},
                "code": {"package": upload(c, str(pkg))["package"]}}
        job = c.submit(spec, name="probe")["id"]
        view = wait_end(c, job, timeout=150)
        assert view["state"] == "succeeded", view.get("failure_reason")
        line = next(x for x in c.logs(job).splitlines() if x.startswith("PROBE "))
    return {**json.loads(line.removeprefix("PROBE ")), "job": job}


def held_processes(up_pid: int, timeout_s: float = 150) -> dict[int, tuple[str, list[int]]]:
    """The stack's processes while the job's payload runs, with its supervisor and a Ray worker among them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = snapshot(up_pid)
        lines = [line for line, _ids in seen.values()]
        payload = any("workers.payload" in x and "bwrap" not in x and "setpriv" not in x for x in lines)
        if payload and any(" -m workers.run " in f"{x} " for x in lines) and any("ray::" in x for x in lines):
            return seen
        time.sleep(0.3)
    raise AssertionError(f"the job's payload never ran: {json.dumps(snapshot(up_pid), indent=1)}")
