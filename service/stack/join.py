"""``tlab join HEAD``: this machine as a Ray worker node of the cluster whose API is at HEAD, and ``tlab leave``.

The admin prints a join token on the head (``tlab join-token``); with it the API hands this machine the Ray head's
address, the cluster's Ray token and the settings its job processes read (``POST /v1/nodes/join``). The node then
runs ``ray start --address ... --block`` as ``tlab up`` runs its head: with this project's interpreter, as the
service user when run as root, from a directory of its own (``$TLAB_HOME/node``: the sandbox binds the node's
starting directory, and ``/`` would bind everything), speaking from the address it reaches the head from (never a
loopback one), and restarted when it dies (``service.stack.supervise``); it has joined, or is back, once the head's
GCS lists its node alive (``service.stack.ray_registered``). Ctrl-C, SIGTERM or ``tlab leave`` take it
out: it first has its jobs moved (``service.stack.leave``: they resume elsewhere from their last checkpoint), then
stops its Ray node.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import httpx

from service.stack.addresses import is_loopback, node_address, resolve
from service.stack.embedded import HEAD_MARK, Stack, wait_for, write_private
from service.stack.leave import DRAIN_TIMEOUT_S, LEFT, OUT, Leaving, detail, said
from service.stack.ports import free_port
from service.stack.service_user import head_env

GCS_CONNECT_S = 5.0
REGISTER_S = 60.0  # a node's raylet must be listed alive by the head's GCS within this of its start
LEAVE_WAIT_S = 60.0
# a node's ports, chosen once and kept across restarts (firewall rules can name them); given, not left to Ray: a
# raylet whose agents pick their own ports waits 15 s for their port files, and dies on a busy machine
NODE_PORTS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
              "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")


class JoinRefused(RuntimeError):
    """The head refused the token, cannot be reached, or this machine's address cannot serve as a node's."""


class NotRegistered(subprocess.SubprocessError):
    """``ray start`` runs, but the head's GCS never listed its node alive."""


def api_url(head: str) -> str:
    return head.rstrip("/") if "://" in head else f"http://{head}"


def ask_to_join(head: str, token: str, address: str) -> dict[str, object]:
    """The head's answer to a join with ``token``: its ``JoinGrant`` (one line on any refusal)."""
    try:
        r = httpx.post(f"{api_url(head)}/v1/nodes/join", headers={"Authorization": f"Bearer {token}"},
                       json={"hostname": socket.gethostname(), "address": address}, timeout=15)
    except httpx.HTTPError as err:
        raise JoinRefused(f"cannot reach the API at {api_url(head)} ({err}): is `tlab up --listen` running there, "
                          "and its port open to this machine?") from err
    if r.status_code != 200:
        raise JoinRefused(f"the head refused to let this machine join ({r.status_code}): {detail(r)}")
    return dict(r.json())


def check_reach(gcs: str, address: str) -> None:
    """The Ray head's GCS port answers from ``address`` (else one line naming the port to open)."""
    host, _, port = gcs.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=GCS_CONNECT_S, source_address=(address, 0)).close()
    except OSError as err:
        raise JoinRefused(f"the Ray head's port {gcs} does not answer from {address} ({err}): open it (and Ray's "
                          "node ports) between the machines, docs/operations.md, Several machines") from err


def name_note(address: str) -> str:
    """A line when this host's name resolves to loopback (Debian's 127.0.1.1): the node and the gangs' collectives
    are bound to ``address`` instead, so nothing relies on the name."""
    name = socket.gethostname()
    try:
        found = resolve(name)
    except ValueError:
        return f"note: host name {name!r} does not resolve; this node is named by its address {address}"
    if is_loopback(found):
        return (f"note: host name {name!r} resolves to {found} (loopback); this node speaks from {address}, and "
                "its jobs' gloo/NCCL are bound to that address's interface")
    return ""


class JoinedNode(Stack):
    """One Ray worker node joined to a head, as the part ``ray`` of a stack (``service.stack.supervise`` restarts it
    as it restarts ``tlab up``'s head)."""

    def __init__(self, home: Path, grant: dict[str, object], address: str, num_cpus: int | None = None,
                 num_gpus: int | None = None, service_user: object = None, head: str = "", token: str = "",
                 drain_s: float = DRAIN_TIMEOUT_S) -> None:
        super().__init__(home, num_cpus=num_cpus, num_gpus=num_gpus, ray_token=str(grant["ray_token"]),
                         service_user=service_user, listen=address)  # type: ignore[arg-type]
        self.gcs = str(grant["ray_address"])
        self.api, self.token = api_url(head), token  # where and with what it leaves (service.stack.leave)
        self.hostname = socket.gethostname()
        self.drain_s = drain_s  # how long it waits for its jobs to move when it leaves
        self.node_env = {str(k): str(v) for k, v in dict(grant.get("env") or {}).items()}  # type: ignore[call-overload]
        self.node_dir = home / "node"

    def start(self) -> JoinedNode:
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.node_dir.mkdir(parents=True, exist_ok=True, mode=0o755)  # where its Ray processes start
        self.open_to_service_user()
        self.start_ray()
        self.wait_registered()
        return self

    def restart(self, name: str) -> None:
        """As ``Stack.restart``; Ray is back once the head's GCS lists its node (else the restart failed: the
        supervisor counts one more death and tries again, or ends in its crash-loop message)."""
        super().restart(name)
        if name == "ray":
            self.wait_registered()

    def wait_registered(self) -> None:
        """Until the head's GCS lists this node alive (``service.stack.ray_registered``, in a process of its own);
        ``NotRegistered`` when it does not within ``REGISTER_S``, ``Interrupted`` on Ctrl-C, a ``RuntimeError`` when
        ``ray start`` exits meanwhile."""
        argv = [sys.executable, "-m", "service.stack.ray_registered", self.gcs, str(self.ray_temp), str(REGISTER_S)]
        probe = subprocess.Popen(argv, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(lambda: probe.poll() is not None, "Ray's node", REGISTER_S + GCS_CONNECT_S + 30,
                     self.procs.get("ray"), self.logs / "ray.log", self.stopping)
        finally:
            if probe.poll() is None:
                probe.kill()
            said = (probe.communicate()[0] or "").strip().splitlines()
        if probe.returncode != 0:
            raise NotRegistered(said[-1] if said else f"the registration check ended with code {probe.returncode}")

    def start_ray(self) -> None:
        self.ray_temp = tempfile.mkdtemp(prefix="tln", dir="/tmp")  # Ray's socket paths are length-limited
        ray_cli = [self.python, "-m", "ray.scripts.scripts"] if self.service_user else [
            str(Path(sys.executable).with_name("ray"))]
        argv = [*ray_cli, "start", "--address", self.gcs, "--block", "--node-ip-address", self.address,
                "--node-name", socket.gethostname(), "--temp-dir", self.ray_temp, "--disable-usage-stats"]
        self.ray_ports = self.ray_ports or {flag: free_port() for flag in NODE_PORTS}
        argv += [str(x) for flag, port in self.ray_ports.items() for x in (flag, port)]
        if self.num_cpus is not None:
            argv += ["--num-cpus", str(self.num_cpus)]
        if self.num_gpus is not None:
            argv += ["--num-gpus", str(self.num_gpus)]
        env = {**self.node_env, HEAD_MARK: self.ray_temp}
        cwd = str(self.node_dir)
        if self.service_user:
            env.update(head_env(self.service_user, Path(self.ray_temp), self.python, self.env().get("PATH", "")))
            os.chown(self.node_dir, self.service_user.uid, self.service_user.gid)
        self._spawn("ray", argv, env, ray=True, user=self.service_user, cwd=cwd)
        write_private(self.node_dir / "joined.json", json.dumps({
            "pid": os.getpid(), "gcs": self.gcs, "address": self.address, "temp": self.ray_temp,
            "drain_s": self.drain_s}) + "\n")

    def stop(self) -> None:
        super().stop()
        (self.node_dir / "joined.json").unlink(missing_ok=True)


def join(home: Path, head: str, token: str, given_address: str = "", num_cpus: int | None = None,
         num_gpus: int | None = None, service_user: object = None, drain_s: float = DRAIN_TIMEOUT_S) -> JoinedNode:
    """A ``JoinedNode`` for the cluster at ``head``, its address and the head's reach checked (not started)."""
    if not token:
        raise JoinRefused("no join token: set TLAB_JOIN_TOKEN (the admin prints one with `tlab join-token`)")
    host = urlparse(api_url(head)).hostname or head
    address = node_address(host, given_address)
    grant = ask_to_join(head, token, address)
    check_reach(str(grant["ray_address"]), address)
    return JoinedNode(home, grant, address, num_cpus, num_gpus, service_user, head, token, drain_s)


def leave(home: Path, wait_s: float = LEAVE_WAIT_S, say: Callable[[str], None] | None = None) -> str:
    """Take out the node ``tlab join`` runs from ``home``: SIGTERM to it, and wait while it has its jobs moved (for
    its drain timeout at most) and stops its Ray node (``wait_s`` more), showing what it says
    (``service.stack.leave``); what happened, in one line."""
    marker = home / "node" / "joined.json"
    if not marker.exists():
        raise JoinRefused(f"no node joined from {home} here (no {marker}): was `tlab join` run with this TLAB_HOME?")
    joined = json.loads(marker.read_text())
    pid, drain_s = int(joined["pid"]), float(joined.get("drain_s") or 0)
    for stale in (LEFT, OUT):  # what an earlier leave said
        (home / "node" / stale).unlink(missing_ok=True)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        marker.unlink(missing_ok=True)
        return f"the node's `tlab join` (pid {pid}) had already stopped"
    deadline = time.monotonic() + drain_s + wait_s
    shown, progress = 0, home / "node" / OUT
    while True:
        stopped = not marker.exists()
        shown = show_new_lines(progress, shown, say)
        if stopped or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if not stopped:
        raise JoinRefused(f"`tlab join` (pid {pid}) did not stop within {drain_s + wait_s:g} s: `kill -INT {pid}`")
    return said(home / "node") or "this node left the cluster"


def show_new_lines(path: Path, shown: int, say: Callable[[str], None] | None) -> int:
    """Print the lines of ``path`` after the first ``shown`` (what the leaving node says); how many there are now."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return shown
    for line in lines[shown:]:
        (say or (lambda x: print(x, file=sys.stderr, flush=True)))(line)
    return max(shown, len(lines))


def run_node(node: JoinedNode) -> int:
    """Start ``node`` and keep it up until Ctrl-C or SIGTERM (``tlab up``'s supervisor and crash-loop rule)."""
    from service.core.signals import stop_on_signals
    from service.stack.embedded import Interrupted
    from service.stack.supervise import Supervisor, supervise_policy

    supervisor = Supervisor(node, supervise_policy())
    stopping = node.stopping = stop_on_signals()
    crash_loop = None
    try:
        node.start()
        note = name_note(node.address)
        if note:
            print(note, flush=True)
        ports = " ".join(str(p) for p in node.ray_ports.values())
        print(f"joined the Ray head at {node.gcs} as {socket.gethostname()} ({node.address}); this node's Ray ports: "
              f"{ports} (open them to the other machines); Ray's logs: {node.ray_temp}. Ctrl-C or `tlab leave` takes "
              "this node out, its jobs moved first.", flush=True)
        crash_loop = supervisor.run(stopping)
        if not crash_loop:
            Leaving(node).run()  # its jobs moved first
    except Interrupted:
        pass
    except (subprocess.SubprocessError, RuntimeError) as err:  # Ray would not start, or its node never registered
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        node.stop()
    if crash_loop:
        print(crash_loop, file=sys.stderr, flush=True)
        return 1
    return 0
