"""No job process is host root: a user's code, submitted through the real stack and run in the real bwrap, probes
what a root payload could do (its uid on the host, ``/proc/sys``, a nested user namespace, ``ptrace`` of the
sandbox's init, a set-uid file in storage, the kernel calls escapes start with, a fork bomb, a Redis login in its
own memory), while the test reads
``/proc/*/status`` on the host for every payload process. Every probe must be refused, and the job still trains."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from service.cli.client import Client
from service.cli.code_zip import upload
from service.core.settings import Settings
from service.stack.embedded import Stack
from tests.service.conftest import Api, tiny, wait_for
from tests.service.test_code_packages import wait_end
from workers.job import job_user, sandbox

pytestmark = pytest.mark.slow

PROBES = r'''
import ctypes, errno, json, os, platform, resource, shutil, subprocess, threading, time
from pathlib import Path

from torch import nn

libc = ctypes.CDLL(None, use_errno=True)
X86 = {"keyctl": 250, "bpf": 321, "perf_event_open": 298, "init_module": 175, "kexec_load": 246,
       "open_by_handle_at": 304}


def refused(call):
    """The errno a raw call failed with (0: it worked)."""
    ctypes.set_errno(0)
    result = call()
    return 0 if result >= 0 else ctypes.get_errno()


def caught(fn):
    try:
        fn()
        return 0
    except (OSError, ValueError) as err:  # (setrlimit above the hard limit: ValueError)
        return getattr(err, "errno", None) or -1


def threads_until_refused(limit):
    stop, made = threading.Event(), []
    try:
        for _ in range(limit):
            t = threading.Thread(target=stop.wait)
            t.start()
            made.append(t)
    except RuntimeError:
        pass
    stop.set()
    for t in made:
        t.join()
    return len(made)


def probe(storage):
    job_dir = Path(storage) / os.listdir(storage)[0]  # its own directory: the only one it sees
    status = dict(line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":\t" in line)
    found = {"uid": os.getuid(), "euid": os.geteuid(), "cap_eff": status["CapEff"].strip(),
             "no_new_privs": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip()}
    found["proc_sys"] = caught(lambda: open("/proc/sys/kernel/printk_ratelimit_burst", "w").close())
    found["userns"] = refused(lambda: libc.unshare(0x10000000))  # CLONE_NEWUSER
    found["unshare_Ur"] = subprocess.run(["unshare", "-Ur", "true"], capture_output=True).returncode
    found["ptrace_1"] = refused(lambda: libc.ptrace(16, 1, None, None))  # PTRACE_ATTACH to the sandbox's init
    found["mount"] = refused(lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
    if platform.machine() == "x86_64":
        found.update({name: refused(lambda nr=nr: libc.syscall(nr, 0, 0, 0, 0, 0)) for name, nr in X86.items()})
    shell = job_dir / "sh"
    shutil.copy("/bin/sh", shell)
    found["chmod_setuid"] = caught(lambda: os.chmod(shell, 0o6755))
    found["create_setuid"] = caught(lambda: os.close(os.open(job_dir / "made", os.O_CREAT | os.O_WRONLY, 0o4755)))
    import gc
    from workers.job.orders import Orders
    logins = [o.redis_url for o in gc.get_objects() if isinstance(o, Orders)] + [
        v for v in os.environ.values() if v.startswith(("redis://", "rediss://", "unix://"))]
    found["redis_logins"] = [x for x in logins if x]  # its orders in its own memory, its environment
    found["mounts"] = sorted({line.split()[4] for line in open("/proc/self/mountinfo")})
    found["nproc"] = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    found["core"] = caught(lambda: resource.setrlimit(resource.RLIMIT_CORE, (1 << 20, 1 << 20)))
    found["threads"] = threads_until_refused(found["nproc"] + 64)
    print("PROBES " + json.dumps(found), flush=True)
    for _ in range(600):  # until the test has looked at the host's /proc
        if (job_dir / "go").exists():
            break
        time.sleep(0.1)


def build(storage):
    probe(storage)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
'''


def payload_uids() -> dict[int, int]:
    """Every sandboxed payload process on the host (``python -m workers.payload`` whose parent is its bwrap, past its
    setpriv): pid -> uid. A built-in job's payload runs unsandboxed, as its supervisor's uid (a test may run those as
    root beside this one), and is not counted."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
            ppid = next(x for x in status.splitlines() if x.startswith("PPid:")).split()[1]
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except (OSError, StopIteration):
            continue
        boxed = Path(parent).name == "bwrap"
        if boxed and Path(argv[0].decode(errors="replace")).name.startswith("python") and b"workers.payload" in argv:
            found[int(pid)] = int(next(x for x in status.splitlines() if x.startswith("Uid:")).split()[1])
    return found


def setid_files(top: Path) -> list[str]:
    return [str(p) for p in top.rglob("*") if not p.is_symlink() and p.stat().st_mode & (stat.S_ISUID | stat.S_ISGID)]


def test_no_job_process_is_host_root_and_every_escape_probe_is_refused(stack: Stack, tmp_path: Path) -> None:
    api = Api(stack)
    api.add_user("mallory")
    with api.client() as admin:
        assert admin.patch("/v1/users/mallory", json={"can_submit_code": True}).status_code == 200
    storage = Path(Settings(TLAB_HOME=stack.home).storage_path)
    pkg = tmp_path / "pkg" / "escape"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(textwrap.dedent(PROBES))
    with Client(stack.url, api.tokens["mallory"]) as c:
        package = upload(c, str(pkg.parent))["package"]
        spec = {**tiny(training={"epochs": 1}), "code": {"package": package},
                "model": {"kind": "custom", "factory": "escape.model:build", "args": {"storage": str(storage)}}}
        job = c.submit(spec, name="escape")["id"]
        wait_for(lambda: "PROBES " in c.logs(job), 120, "the payload's probes")
        seen_on_host = payload_uids()
        (storage / job / "go").touch()
        view = wait_end(c, job)
        found = json.loads(next(x for x in c.logs(job).splitlines() if x.startswith("PROBES ")).removeprefix("PROBES "))
    assert view["state"] == "succeeded", view.get("failure_reason")
    allowed = ("/", "/dev", "/proc", "/tmp", "/usr", *(d for d in ("/bin", "/lib", "/lib64", "/sbin")
                                                     if not Path(d).is_symlink()))
    python = {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix)} | {
        str(Path(p).resolve()) for p in sandbox.our_package_dirs()}
    extra = [m for m in found["mounts"] if m not in allowed and not m.startswith(("/dev/", "/proc/", "/etc/"))
             and m not in python and m != str(storage / job) and "/runtime_resources/working_dir_files/" not in m]
    assert extra == [], extra  # exactly what it needs: no home, no other job, no Ray session beyond its code
    assert seen_on_host and 0 not in seen_on_host.values(), seen_on_host  # every payload here, this one included
    assert job_user.job_uid(job) in seen_on_host.values(), seen_on_host
    assert found["uid"] == found["euid"] == job_user.job_uid(job), found
    assert (found["cap_eff"], found["no_new_privs"], found["seccomp"]) == ("0000000000000000", "1", "2"), found
    assert found["proc_sys"] in (13, 30), found  # EACCES (not root) or EROFS (/proc/sys bound read-only)
    assert found["userns"] == 1 and found["unshare_Ur"] != 0, found  # EPERM: no nested user namespace
    assert found["ptrace_1"] == 1 and found["mount"] == 1, found
    assert all(found[name] == 1 for name in ("keyctl", "bpf", "perf_event_open", "init_module", "kexec_load",
                                              "open_by_handle_at") if name in found), found
    assert found["redis_logins"] == [], found  # its records go through its supervisor: no Redis login to steal
    assert found["chmod_setuid"] == 1 and found["create_setuid"] == 1, found
    assert found["core"] != 0, found  # no core dump, and it cannot raise its own limit (no core_pattern run)
    assert found["nproc"] == job_user.DEFAULT_MAX_PROCS and found["threads"] < found["nproc"], found
    assert setid_files(storage / job) == []
    sh = storage / job / "sh"
    assert sh.is_file() and sh.stat().st_uid == job_user.job_uid(job)  # the job's own file, not root's


def test_a_setid_bit_left_in_a_jobs_directory_is_stripped(tmp_path: Path) -> None:
    """The supervisor's second line after each payload (the seccomp filter is the first); a link is never
    followed, so a set-uid file it points to elsewhere keeps its bit."""
    job_dir, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    (job_dir / "sub").mkdir(parents=True)
    elsewhere.write_text("x")
    os.chmod(elsewhere, 0o4755)
    for name in ("a", "sub/b"):
        (job_dir / name).write_text("x")
        os.chmod(job_dir / name, 0o6755)
    os.chmod(job_dir / "sub", 0o2755)
    (job_dir / "link").symlink_to(elsewhere)
    assert job_user.strip_setid(job_dir) == 3
    assert setid_files(job_dir) == []
    assert elsewhere.stat().st_mode & stat.S_ISUID
