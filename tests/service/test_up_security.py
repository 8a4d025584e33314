"""`tlab up` as a user starts it, checked as an attacker on the same network or machine would: Redis asks for a
password, no server of the stack listens beyond loopback, and what it keeps under TLAB_HOME is the owner's only."""

from __future__ import annotations

import ipaddress
import stat
import time
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from tests.service.conftest import tlab_up


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
def test_tlab_up_keeps_redis_ray_and_its_files_private(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with tlab_up(home, "--num-cpus", "1") as (proc, url, printed):
        password = (home / "redis.password").read_text().strip()
        assert password not in "".join(printed + [proc.stdout.readline() if proc.stdout else ""])
        token = (home / "admin.token").read_text().strip()
        deadline = time.monotonic() + 60  # the scheduler reached Redis with the password, and Ray
        while time.monotonic() < deadline and httpx.get(f"{url}/readyz", timeout=10).status_code != 200:
            time.sleep(0.3)
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
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
        assert redis.Redis(host="127.0.0.1", port=redis_port, password=password).ping()

        for name in ("admin.token", "redis.password", "redis.conf", "api.url"):
            assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
        shared = [str(p) for p in [home, *home.rglob("*")] if p.stat().st_mode & 0o077]
        assert shared == [], f"readable by others under TLAB_HOME: {shared}"
    assert proc.returncode == 0
