"""Under a root ``tlab up`` no Ray process of the stack is root: a real ``tlab up`` started as root runs one job with
a user's code, and while it runs the test reads ``/proc/<pid>/status`` on the host for every process of the stack's
Ray head (its tree, and every process whose environment holds ``TLAB_RAY_HEAD=<its temp dir>``: daemons, workers,
the job's supervisor) and every payload (``workers.payload`` in its command line). None has uid 0 (real, effective,
saved or file-system). Redis, the API and the scheduler are excepted: they stay root, run no job code and hold the
secrets, which stay root's 0600 (checked with ``os.stat``). The job runs on the service user's Python (its
``sys.executable``, printed by the job, is not under ``/root``) and succeeds."""

from __future__ import annotations

import json
import os
import pwd
import stat
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from service.cli.client import Client
from service.cli.code_zip import upload
from service.core.sandbox_state import probe
from service.core.settings import Settings
from service.stack.embedded import HEAD_MARK
from tests.service.conftest import closed_checkout, tiny, tlab_up
from tests.service.stack.conftest import passable_home
from tests.service.test_code_packages import wait_end

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="the service user is a root tlab up's"),
              pytest.mark.skipif(bool(probe()), reason="no sandbox here: jobs with users' code are refused"),
              pytest.mark.skipif(closed_checkout() is not None,
                                 reason=f"this checkout lies under {closed_checkout()}, closed to other users: a "
                                        "root tlab up refuses to run Ray as its service user from it")]

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


@pytest.fixture()
def home() -> Iterator[Path]:
    with passable_home() as path:
        yield path


def test_no_ray_worker_supervisor_or_payload_is_root_under_a_root_tlab_up(home: Path, tmp_path: Path) -> None:
    user = pwd.getpwnam(Settings().service_user) if _exists(Settings().service_user) else None
    pkg = tmp_path / "pkg" / "slow"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(textwrap.dedent(SLOW))
    with tlab_up(home, "--num-cpus", "2") as (proc, url, printed):
        user = user or pwd.getpwnam(Settings().service_user)  # made by tlab up when it was missing
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
    assert proc.returncode == 0


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


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False
