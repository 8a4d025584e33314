"""What the scheduler needs from Ray: the nodes and their resources, and Ray jobs (submit, status, stop, logs).

Only the Jobs API and the State API over the dashboard's HTTP address; the service never joins
the cluster as a driver. ``StaticCluster`` stands in for the node list when a fixed cluster is
configured (``TLAB_CLUSTER_NODES``), for simulations and benchmarks of the scheduling policy.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from api_schemas.jobs import Demand
from api_schemas.spec import GIB, ray_memory
from service.rules.policy import Node

ACCELERATOR_PREFIX = "accelerator_type:"  # a Ray node's GPU model is a resource of this name (1 per node)
# how Ray's State API words the end of a node stopped (`ray stop`, `tlab leave`) or drained on purpose
# (ray.dashboard.utils.compose_state_message): such a node left the cluster; it is not lost
LEFT = ("Expected termination", "Terminated due to preemption")


@dataclass(frozen=True)
class Used:
    """What Ray reports in use on a node (None: not known)."""

    cpus: float | None = None
    gpus: float | None = None
    memory_gb: float | None = None

    @classmethod
    def of(cls, usage: dict[str, list[float]]) -> Used:
        """From the autoscaler's ``usageByNode`` entry: resource -> [used, total] (memory in bytes)."""
        memory = usage.get("memory")
        return cls(cpus=float((usage.get("CPU") or [0.0])[0]), gpus=float((usage.get("GPU") or [0.0])[0]),
                   memory_gb=None if not memory else float(memory[0]) / GIB)


@dataclass(frozen=True)
class NodeRecord:
    """One node as Ray's State API lists it: alive, or dead and whether it ``left`` on purpose (``LEFT``)."""

    node: Node
    alive: bool
    left: bool = False
    started_ms: int = 0


def lost_of(records: Sequence[NodeRecord]) -> list[Node]:
    """The dead nodes that are lost: not those that left on purpose (stopped, or drained as ``tlab leave`` drains a
    node), nor those whose host (name and address) is alive again or joined again after them, whatever became of
    that later node: a host lost, rebooted, joined again and then taken out with ``tlab leave`` is out, not lost."""
    def host(r: NodeRecord) -> tuple[str | None, str | None]:
        return r.node.hostname, r.node.address

    back = {host(r) for r in records if r.alive}
    latest: dict[tuple[str | None, str | None], int] = {}
    for r in records:
        latest[host(r)] = max(latest.get(host(r), 0), r.started_ms)
    return [r.node for r in records if not r.alive and not r.left and host(r) not in back
            and r.started_ms >= latest[host(r)]]


class ClusterSource(Protocol):
    def nodes(self) -> list[Node]: ...


class StaticCluster:
    """A fixed list of nodes, from JSON ``[{"id": "n1", "cpus": 8, "gpus": 2, "memory_gb": 64}, ...]`` (no
    ``memory_gb``: not known, no limit; ``hostname`` and ``address`` may name a node)."""

    def __init__(self, spec: str | list[dict]) -> None:
        items = json.loads(spec) if isinstance(spec, str) else spec
        self._nodes = [Node(id=str(n["id"]), cpus=float(n.get("cpus", 0)), gpus=float(n.get("gpus", 0)),
                            gpu_type=n.get("gpu_type"),
                            memory_gb=None if n.get("memory_gb") is None else float(n["memory_gb"]),
                            hostname=n.get("hostname"), address=n.get("address")) for n in items]

    def nodes(self) -> list[Node]:
        return list(self._nodes)

    def lost(self) -> list[Node]:
        return []


class RayNodes:
    """Alive nodes of a Ray cluster: their total CPUs, GPUs and memory (State API over the dashboard address) and
    what Ray reports in use on each now (the head's autoscaler status, refreshed every few seconds; unknown when
    the head runs no autoscaler monitor or its report is stale)."""

    STALE_S = 60.0
    REFRESH_S = 2.0  # Ray's usage report is asked again at most this often (a tick may be every 0.2 s)

    def __init__(self, address: str, refresh_s: float = REFRESH_S) -> None:
        self.address = address.rstrip("/")
        self.refresh_s = refresh_s
        self._used: tuple[float, dict[str, Used]] | None = None  # (when, what) it last answered
        self._lost: dict[str, Node] = {}  # the nodes Ray declared dead, by id (``lost``)
        try:  # the cluster's token, as Ray's own clients send it
            from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

            self.headers = get_auth_headers_if_auth_enabled({})
        except Exception:  # an older or newer Ray without it: the usage is simply not known
            self.headers = {}

    def nodes(self) -> list[Node]:
        """The alive nodes, asked each time (a node's loss must be seen before its job's failure is read as the
        job's own), with what Ray reports in use on each as of at most ``refresh_s`` ago (``usage``)."""
        from ray.util.state import list_nodes

        used = self.usage()
        records: list[NodeRecord] = []
        for n in list_nodes(address=self.address, detail=True, raise_on_missing_output=False):
            res = n.resources_total or {}
            memory = res.get("memory")  # bytes of Ray's logical memory resource: what entrypoint_memory holds
            u = used.get(n.node_id) or Used()
            node = Node(id=n.node_id, cpus=float(res.get("CPU", 0)), gpus=float(res.get("GPU", 0)),
                        cpus_used=u.cpus, gpus_used=u.gpus, gpu_type=gpu_type_of(res),
                        memory_gb=None if memory is None else float(memory) / GIB, memory_used_gb=u.memory_gb,
                        hostname=n.node_name if n.node_name and n.node_name != n.node_ip else None,
                        address=n.node_ip or None)
            records.append(NodeRecord(node, n.state == "ALIVE", (n.state_message or "").startswith(LEFT),
                                      int(n.start_time_ms or 0)))
        self._lost = {n.id: n for n in lost_of(records)}
        return [r.node for r in records if r.alive]

    def lost(self) -> list[Node]:
        """The nodes Ray declared dead at the last ``nodes`` that are still lost (``lost_of``)."""
        return list(self._lost.values())

    def usage(self) -> dict[str, Used]:
        """``ask_usage``'s answer of at most ``refresh_s`` ago: it costs the head and this process ~27 ms of CPU
        (the autoscaler's report it reads is itself refreshed only every ~5 s)."""
        now = time.monotonic()
        if self._used is None or now - self._used[0] >= self.refresh_s:
            self._used = (now, self.ask_usage())
        return self._used[1]

    def ask_usage(self) -> dict[str, Used]:
        """node id -> what is in use on it, from ``/api/cluster_status``; empty when not known."""
        import httpx

        try:
            r = httpx.get(f"{self.address}/api/cluster_status", headers=self.headers, timeout=5)
            r.raise_for_status()
            status = r.json()["data"]["clusterStatus"] or {}
            if time.time() - float(status.get("time") or 0) > self.STALE_S:
                return {}
            return {node_id: Used.of(usage) for node_id, usage in status["loadMetricsReport"]["usageByNode"].items()}
        except (httpx.HTTPError, ValueError, LookupError, TypeError, AttributeError):
            return {}  # no monitor on the head, another Ray's format, or the head is busy: the ledger alone


def gpu_type_of(resources: dict[str, float]) -> str | None:
    """A node's GPU model from its resources (Ray gives a GPU node ``accelerator_type:<model>``)."""
    return next((k.split(":", 1)[1] for k in sorted(resources) if k.startswith(ACCELERATOR_PREFIX)), None)


IN_DRIVER = "TLAB_IN_DRIVER"  # "0": a 1-worker experiment runs as a TorchTrainer too (workers.run.in_driver)
PLACEMENT = "TLAB_PLACEMENT"  # the scheduler's node per worker, for a driver that leads a gang
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node's own label: its node id
_RAY_NODE_ID = re.compile(r"[0-9a-f]{56}")  # a Ray node id in hex (a static cluster's names are not)


def trains_in_driver(module: str, demand: Demand | None, env: dict[str, str]) -> bool:
    """An experiment trains in its Ray job's driver (``workers.on_ray.driver``; with several workers the driver is rank
    0 of the gang it leads, ``workers.on_ray.gang``) unless ``TLAB_IN_DRIVER=0``; a sweep's driver only waits for its
    trials, which hold the CPUs."""
    return module == "workers.run" and demand is not None and env.get(IN_DRIVER) != "0"


def driver_options(demand: Demand | None, placement: Sequence[str] = ()) -> dict[str, Any]:
    """What a Ray job's driver asks Ray for: nothing for one that starts a worker group or trials (they hold the
    resources), else the worker's CPUs and GPUs on the node the scheduler planned (Ray schedules the driver, and
    sets its ``CUDA_VISIBLE_DEVICES``), so Ray holds exactly what the scheduler's ledger counts."""
    if demand is None:
        return {"entrypoint_num_cpus": 0}
    options: dict[str, Any] = {"entrypoint_num_cpus": demand.cpus_per_worker}
    if demand.gpus_per_worker > 0:
        options["entrypoint_num_gpus"] = demand.gpus_per_worker
    if demand.memory_gb:  # resources.memory_gb: Ray holds it on the node (the OOM killer's victim is told to set it)
        options["entrypoint_memory"] = ray_memory(demand.memory_gb)
    if demand.gpu_type:  # what Ray's own accelerator_type= option asks: a sliver of the node's type resource
        options["entrypoint_resources"] = {accelerator_resource(demand.gpu_type): 0.001}
    if placement and _RAY_NODE_ID.fullmatch(placement[0]):
        options["entrypoint_label_selector"] = {NODE_ID_LABEL: placement[0]}
    return options


def accelerator_resource(gpu_type: str) -> str:
    """The resource Ray gives each node with GPUs of that model (``accelerator_type:H100``)."""
    return f"{ACCELERATOR_PREFIX}{gpu_type}"


def gpu_env(demand: Demand | None) -> dict[str, str]:
    """A job that asked for no GPU sees none: ``CUDA_VISIBLE_DEVICES`` empty for its driver and every process it
    starts (Ray 2.60 leaves the variable alone for a process given 0 GPUs, so it would see every card of its
    node). A process given a share is told its GPU by Ray, which sets the variable over this one."""
    return {"CUDA_VISIBLE_DEVICES": ""} if demand is not None and demand.gpus_per_worker <= 0 else {}


def with_credentials(env: dict[str, str], credentials: dict[str, str]) -> dict[str, str]:
    """A job's ``env_vars`` with its credentials (``service.launch.job_acl``): its one-time ticket replaces the
    service's own ``REDIS_URL``, so no Ray job's runtime_env (which every job's code can list) holds a Redis
    password."""
    return {**{k: v for k, v in env.items() if not (credentials and k == "REDIS_URL")}, **credentials}


# Ray job status -> how the scheduler reads it
RAY_ACTIVE = {"PENDING", "RUNNING"}
RAY_DONE = {"SUCCEEDED", "FAILED", "STOPPED"}


class RayJobs:
    """Ray jobs through ``JobSubmissionClient``: one per attempt of an experiment, with a fixed
    submission id (``tlab-<job>-<attempt>``) so a restarted scheduler can never start one twice."""

    def __init__(self, address: str, env: dict[str, str], python: str | None = None,
                 code: Callable[[str], dict[str, Any]] | None = None,
                 credentials: Callable[[str, str], dict[str, str]] | None = None) -> None:
        from ray.job_submission import JobSubmissionClient

        self.client = JobSubmissionClient(address)
        self.env = env
        self.python = python or sys.executable
        self.code = code  # job id -> its code's runtime_env part (service.core.code_store.JobCode), if any
        self.credentials = credentials  # (job id, submission id) -> its one-time ticket (service.launch.job_acl)

    def runtime_env(self, job_id: str, env: dict[str, str]) -> tuple[dict[str, Any], str]:
        """The job's runtime_env (its environment, and its package as ``working_dir`` and requirements as ``pip``:
        Ray uploads the zip once per content, unpacks it on each node and puts it first on every worker's path)
        and the Python to start: with ``pip``, the one of the virtualenv Ray makes (first on its PATH)."""
        code = self.code(job_id) if self.code else {}
        return {"env_vars": env, **code}, "python" if code.get("pip") else self.python

    @staticmethod
    def submission_id(job_id: str, attempt: int) -> str:
        return f"tlab-{job_id}-{attempt}"

    def submit(self, job_id: str, submission_id: str, module: str = "workers.run", demand: Demand | None = None,
               placement: Sequence[str] = ()) -> None:
        """Start ``python -m MODULE --job ID`` as a Ray job; a second call with the id is a no-op. ``demand`` and
        ``placement`` (the scheduler's node per worker) decide what the driver holds: ``driver_options``."""
        in_driver = trains_in_driver(module, demand, self.env)
        env = {**self.env, **gpu_env(demand)}
        if module == "workers.run":  # the driver takes the path the resources were asked for
            env[IN_DRIVER] = "1" if in_driver else "0"
            env[PLACEMENT] = json.dumps(list(placement))  # where its gang's other ranks go (workers.on_ray.gang)
        if self.credentials:  # made right before each submit, the same again for the same submission id
            # Ray has it already when an earlier submit got an error after Ray took it: its ticket may have been
            # redeemed, and making it again would arm a spent ticket for whoever reads the runtime_env
            if self.status(submission_id) is not None:
                return
            env = with_credentials(env, self.credentials(job_id, submission_id))
        runtime_env, python = self.runtime_env(job_id, env)
        try:
            self.client.submit_job(
                entrypoint=f"{python} -m {module} --job {job_id}",
                submission_id=submission_id,
                runtime_env=runtime_env,
                metadata={"tlab_job": job_id},
                **driver_options(demand if in_driver else None, placement),
            )
        except RuntimeError as err:  # the Jobs API answers an existing id with HTTP 400 "already exists"
            if "already exists" not in str(err):
                raise

    def status(self, submission_id: str) -> str | None:
        """PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED, or None when Ray does not know the job."""
        try:
            return str(self.client.get_job_status(submission_id).value)
        except RuntimeError as err:
            if "does not exist" in str(err) or "404" in str(err):
                return None
            raise

    def message(self, submission_id: str) -> str:
        try:
            return self.client.get_job_info(submission_id).message or ""
        except RuntimeError:
            return ""

    def exit_code(self, submission_id: str) -> int | None:
        """The ended Ray job's driver exit status (negative: the signal that ended it), None when not known."""
        try:
            code = self.client.get_job_info(submission_id).driver_exit_code
        except RuntimeError:
            return None
        return None if code is None else int(code)

    def stop(self, submission_id: str) -> None:
        try:
            self.client.stop_job(submission_id)
        except RuntimeError as err:
            if "does not exist" not in str(err):
                raise

    def logs(self, submission_id: str) -> str | None:
        try:
            return self.client.get_job_logs(submission_id)
        except RuntimeError:
            return None
