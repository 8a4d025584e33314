"""Real hosts on one machine: each a network namespace on a bridge (its own address), with its own host name (UTS
namespace), process space (PID namespace, its own /proc), and private /tmp, /dev/shm and /etc/hosts (mount
namespace: a Ray node's temp dir, a node's storage cache, Debian's ``127.0.1.1 <name>`` line). The serving host is
this process's own namespace, on the bridge's address; the project's files (the checkout, its interpreter) are
the same on every host, as when a lab installs it on each machine (a checkout under /tmp too: bound back into each
host's own /tmp).

``Lab.host(name)`` boots one; ``Host.run`` starts a process in it; ``Host.cut``/``heal`` take its link down and up
(its processes keep running), ``Host.cut_off`` for a block; ``Host.kill`` kills every process on it at once (its
PID namespace's init).
``Lab.close`` removes every namespace, link and bridge it made, whatever state the test left them in.

Needs root and ``ip``, ``unshare``, ``nsenter`` (util-linux); ``available()`` says why not where not."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
HOSTS_FILE = "127.0.0.1 localhost\n127.0.1.1 {name}\n"  # a Debian host: its own name resolves to loopback


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def available() -> str:
    """Why hosts cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "unshare", "nsenter") if not shutil.which(t)]
    if missing:
        return f"missing {', '.join(missing)}"
    probe = f"tlprobe{os.getpid() % 100000}"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as err:
        return f"cannot make a network namespace: {err}"
    return ""


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Host:
    """One host: ``address`` on the lab's bridge, ``hostname``, and ``init``: PID 1 of its PID namespace."""

    def __init__(self, lab: Lab, name: str, address: str) -> None:
        self.lab, self.name, self.address = lab, name, address
        self.hostname = f"{name}-{lab.tag}"
        self.ns, self.link = f"{lab.tag}-{name}", f"{lab.tag}{name}"[:15]  # link names: 15 characters at most
        self.init: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []
        self.files = lab.root / name  # its /etc/hosts, outside the namespace

    def boot(self) -> None:
        """Its namespace, link and init (again after ``kill``: a rebooted machine at the same address)."""
        if not Path(f"/run/netns/{self.ns}").exists():
            sh("ip", "netns", "add", self.ns)
            sh("ip", "link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
            sh("ip", "link", "set", self.link, "master", self.lab.bridge, "up")
            sh("ip", "-n", self.ns, "addr", "add", f"{self.address}/24", "dev", "eth0")
            sh("ip", "-n", self.ns, "link", "set", "eth0", "up")
            sh("ip", "-n", self.ns, "link", "set", "lo", "up")
            sh("ip", "-n", self.ns, "route", "add", "default", "via", self.lab.gateway)
        self.files.mkdir(parents=True, exist_ok=True)
        (self.files / "hosts").write_text(HOSTS_FILE.format(name=self.hostname))
        # the checkout (and its interpreter) under /tmp, as a fresh clone may be: opened before the host's own /tmp
        # hides it, and bound back at its path inside that /tmp
        kept = [p for p in (CHECKOUT, Path(sys.prefix).resolve()) if p.is_relative_to("/tmp")]
        kept = [p for p in kept if not any(p != q and p.is_relative_to(q) for q in kept)]
        opened = "".join(f"exec {3 + i}<{p} && " for i, p in enumerate(kept))
        bound = "".join(f"mkdir -p {p} && mount --no-canonicalize --bind /proc/self/fd/{3 + i} {p} && "  # the fd's
                        for i, p in enumerate(kept))  # own folder, not its path's in the new /tmp
        setup = (f"{opened}hostname {self.hostname} && mount --bind {self.files / 'hosts'} /etc/hosts && "
                 f"mount -t tmpfs -o mode=1777 tmpfs /tmp && {bound}mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
                 "exec sleep infinity")
        self.init = subprocess.Popen(["ip", "netns", "exec", self.ns, "unshare", "--uts", "--mount", "--pid",
                                      "--fork", "--kill-child", "--mount-proc", "sh", "-c", setup])
        deadline = time.monotonic() + 10
        while self.init_pid() is None:
            assert time.monotonic() < deadline and self.init.poll() is None, f"host {self.name} did not boot"
            time.sleep(0.05)

    def init_pid(self) -> int | None:
        """PID (in this namespace) of the host's ``sleep infinity``: PID 1 of its own namespace."""
        assert self.init is not None
        for pid in [*children(self.init.pid), *(g for c in children(self.init.pid) for g in children(c))]:
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep"):
                    return pid
            except OSError:  # a setup step (mount, hostname) that just ended
                continue
        return None

    def run(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """``argv`` on this host (its network, name, mounts and process space), its output in ``log``."""
        pid = self.init_pid()
        assert pid is not None, f"host {self.name} is down"
        with log.open("ab") as out:
            proc = subprocess.Popen(["nsenter", "-t", str(pid), "--net", "--uts", "--mount", "--pid", "--", *argv],
                                    env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/")
        self.procs.append(proc)
        return proc

    def running(self, needle: bytes) -> list[int]:
        """The processes of this host whose command line holds ``needle``: below its init (what was orphaned there)
        and below the ``nsenter`` of each ``run`` (their ids in the serving host's namespace; psutil reads every
        process's parent, where ``/proc/<pid>/task/<pid>/children`` lists only the main thread's children)."""
        import psutil

        found = []
        for root in (p for p in (self.init, *self.procs) if p is not None and p.poll() is None):
            try:
                below = psutil.Process(root.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for proc in below:
                try:
                    if needle in b" ".join(a.encode() for a in proc.cmdline()):
                        found.append(proc.pid)
                except psutil.Error:  # ended meanwhile
                    continue
        return found

    def cut(self) -> None:
        """Its link down: alive, unreachable."""
        sh("ip", "link", "set", self.link, "down")

    def heal(self) -> None:
        """Its link up again (nothing changes if it was up)."""
        sh("ip", "link", "set", self.link, "up")

    @contextmanager
    def cut_off(self) -> Iterator[None]:
        """Cut for the block; healed when it ends, whether or not the test's checks held (a host left cut would
        fail every later test of the lab with another test's fault)."""
        self.cut()
        try:
            yield
        finally:
            self.heal()

    def network(self) -> str:
        """Its link as the bridge sees it, and its own addresses and neighbours (a failure's record)."""
        said = []
        for argv in (["ip", "-br", "link", "show", self.link], ["ip", "-n", self.ns, "-br", "addr"],
                     ["ip", "-n", self.ns, "neigh"]):
            out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            said.append(f"$ {' '.join(argv)}\n{(out.stdout + out.stderr).strip()}")
        return "\n".join(said)

    def kill(self) -> None:
        """Every process on the host at once (its PID namespace ends with its init)."""
        pid = self.init_pid() if self.init and self.init.poll() is None else None
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        if self.init is not None:
            self.init.wait(timeout=30)
        for proc in self.procs:
            proc.wait(timeout=30)  # the nsenter processes end with what they started
        self.procs.clear()

    def remove(self) -> None:
        try:
            self.kill()
        finally:
            subprocess.run(["ip", "link", "del", self.link], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)


class Lab:
    """A bridge with this process's namespace on ``gateway`` (the serving host) and the hosts made on it."""

    def __init__(self, root: Path) -> None:
        n = os.getpid() % 200 + 20
        self.tag = f"tl{n}"
        self.root = root
        self.bridge = f"{self.tag}br"
        self.subnet = f"10.233.{n}"
        self.gateway = f"{self.subnet}.1"
        self.hosts: dict[str, Host] = {}
        self.remove_leftovers()
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def host(self, name: str) -> Host:
        host = self.hosts[name] = Host(self, name, f"{self.subnet}.{10 + len(self.hosts) + 1}")
        host.boot()
        return host

    def remove_leftovers(self) -> None:
        """What a killed earlier run of this process id left (its namespaces, links and bridge)."""
        for ns in Path("/run/netns").glob(f"{self.tag}-*") if Path("/run/netns").exists() else ():
            subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)

    def close(self) -> None:
        try:
            for host in self.hosts.values():
                host.remove()
        finally:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
