"""`tlab up` as a user starts it, checked as an attacker on the same network or machine would: Redis asks for a
password, no server of the stack listens beyond loopback, what it keeps under TLAB_HOME is the owner's only (as root:
the home passable, the storage the service user's, the default data root readable by its group), and a job's code
finds no service secret in its environment (it reaches Redis only as its own ACL user)."""

from __future__ import annotations

import ipaddress
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from service.cli.client import Client
from service.cli.code_zip import upload
from tests.service.conftest import service_user_env, tiny, tlab_up

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


@pytest.mark.slow
def test_tlab_up_keeps_redis_ray_and_its_files_private(up_home: Path) -> None:
    home = up_home
    with tlab_up(home, "--num-cpus", "1") as (proc, url, printed):
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
        probe = job_environment(url, token, home / "pkg")
        # in its sandbox it holds no Redis login at all: its records go through its supervisor (workers.payload)
        assert probe["own"] is None and probe["inherited"] is None, probe
        assert not [k for k in SERVICE_ONLY if k in probe["env"]], sorted(probe["env"])
        held = [k for k, v in probe["env"].items() if password in v or token in v]
        assert held == [], f"the job's environment holds the service's secrets in {held}"
    assert proc.returncode == 0


def job_environment(url: str, token: str, pkg: Path) -> dict:
    """Run ``PROBE`` as a job of the stack at ``url``: what it printed, with its ``job`` id."""
    (pkg / "probe").mkdir(parents=True)
    (pkg / "probe" / "__init__.py").write_text("")
    (pkg / "probe" / "model.py").write_text(textwrap.dedent(PROBE))
    with Client(url, token) as c:
        spec = {**tiny(training={"epochs": 1}), "model": {"kind": "custom", "factory": "probe.model:build"},
                "code": {"package": upload(c, str(pkg))["package"]}}
        job = c.submit(spec, name="probe")["id"]
        deadline = time.monotonic() + 150
        while (view := c.get(job))["state"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, view
            time.sleep(0.5)
        assert view["state"] == "succeeded", view.get("failure_reason")
        line = next(x for x in c.logs(job).splitlines() if x.startswith("PROBE "))
    return {**json.loads(line.removeprefix("PROBE ")), "job": job}


@pytest.mark.skipif(os.geteuid() != 0, reason="the service user is a root tlab up's")
@pytest.mark.skipif(bool(service_user_env()), reason="this checkout is closed to other users: no service user here")
def test_a_root_tlab_up_whose_home_the_service_user_cannot_reach_stops_with_one_line(tmp_path: Path) -> None:
    """pytest's temp root is 0700, as /root is: nothing opens it, the start is refused, naming it and the way out."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS")}
    env["TLAB_HOME"] = str(tmp_path / "home")
    out = subprocess.run([str(Path(sys.executable).parent / "tlab"), "up"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: TLAB_HOME {tmp_path / 'home'} lies under ") and "TLAB_HOME=/var/lib/tlab" in last
    closed = Path(last.split(" lies under ")[1].split(" (mode")[0])
    assert stat.S_IMODE(closed.stat().st_mode) == 0o700  # left as it was
    assert not (tmp_path / "home" / "redis").exists()  # nothing started
