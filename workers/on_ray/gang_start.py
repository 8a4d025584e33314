"""The other ranks of a gang (``workers.on_ray.gang``), started as early as the driver knows its spec: before it
imports torch and builds its own model, so their Ray workers start and import in parallel with it.

Light on imports on purpose (no torch here). The driver listens on a socket it opens now and hands the port to
the ranks; rank 0's TCP store later serves on that very socket (``master_listen_fd``), so no other process can
take the port in between.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from api_schemas import ExperimentSpec
from api_schemas.spec import ray_memory

_RAY_NODE_ID = re.compile(r"[0-9a-f]{56}")  # a Ray node id (a static cluster's node names are not)
STOP_GRACE_S = 1.0  # how long a failed try's ranks may take to end on their own before a cancel


def rank_options(spec: ExperimentSpec, node: str | None) -> dict[str, Any]:
    """A rank's Ray task: the worker's CPUs and GPUs, on the node the scheduler planned (if it named one)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    r = spec.resources
    options: dict[str, Any] = {"num_cpus": r.cpus_per_worker, "num_gpus": r.gpus_per_worker, "max_retries": 0}
    if r.memory_gb:
        options["memory"] = ray_memory(r.memory_gb)  # resources.memory_gb, reserved on the rank's node
    if r.gpu_type:
        options["accelerator_type"] = r.gpu_type  # a node with accelerator_type:<gpu_type> (resources.gpu_type)
    if node and _RAY_NODE_ID.fullmatch(node):
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    return options


def gang_rank(*args: Any) -> None:
    """A rank's task (its process is titled ``ray::gang_rank`` while it runs). A trampoline, on purpose: this module
    stays torch-free for the driver that starts the ranks, and the supervisor (which imports ``Ranks`` from here)
    is imported only when the task runs, on the rank's node (tests/test_walls.py declares this circle)."""
    from workers.on_ray.supervisor import supervise_rank  # its payload joins the gang, in a sandbox

    supervise_rank(*args)


class Ranks:
    """Ranks 1..N-1 of one try of the gang, running as Ray tasks, and the socket they will meet rank 0 on.
    ``start_from``: the checkpoint the driver decided, once, the job starts from (None: from scratch), handed to each
    rank as its task's argument; the ranks never read it from the job's keys."""

    def __init__(self, spec: ExperimentSpec, job_id: str, redis_url: str, storage: str | Path,
                 placement: Sequence[str], artifacts: str | Path | None, start_from: str | Path | None) -> None:
        import ray

        self.start_from = start_from
        if not ray.is_initialized():  # each rank keeps its own log: rank 0's (this driver's) holds its lines only
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
        self.world, self.host = spec.resources.workers, ray.util.get_node_ip_address()
        self.sock = socket.create_server((self.host, 0))
        self.port = int(self.sock.getsockname()[1])
        task, self.refs = ray.remote(gang_rank), []
        try:
            for k in range(1, self.world):
                options = rank_options(spec, placement[k] if k < len(placement) else None)
                self.refs.append(task.options(**options).remote(
                    spec.model_dump_json(), job_id, redis_url, str(storage), k, self.world, self.host, self.port,
                    str(artifacts) if artifacts else None, str(self.start_from) if self.start_from else None))
        except BaseException:
            self.stop()
            raise

    def wait(self) -> None:
        """Until every rank has ended; a rank's own error is raised here."""
        import ray

        ray.get(self.refs)
        self.refs = []  # ended: ``stop`` must not cancel them (see there)

    def raise_if_ended(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for a rank's task to end; one that did (before the gang formed) raises its
        error here, or says it ended without joining."""
        import ray

        done, _ = ray.wait(self.refs, num_returns=1, timeout=wait_s)
        if done:
            ray.get(done)
            raise RuntimeError("a rank of the gang ended before it joined: see its log (tlab logs --rank N)")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """End those still running (a failed or stopped try): their processes end. Idempotent.
        (``end_tasks``: a rank that ends on its own within ``grace_s`` is not cancelled.)"""
        refs, self.refs = self.refs, []
        end_tasks(refs, grace_s)
        self.sock.close()  # (nothing once rank 0's store took it over: detached)


def end_tasks(refs: Sequence[Any], grace_s: float) -> None:
    """Force-cancel those of ``refs`` that have not ended within ``grace_s``, and only those.

    Ray (2.60) aborts the process that cancels a task whose reply it is handling (a RAY_CHECK in its task
    manager, "Tried to complete task that was not pending", ray-project/ray#54527): ``ray.get`` returns as soon
    as the reply's return value is stored, before Ray is done with the reply, so a cancel right after it killed
    the driver (the fresh-clone run: the gang test's pytest worker, after a retry that succeeded). A bare
    get-then-cancel loop of 2 tasks a round died in 8 runs of 8, after 5 to 212 rounds; with this, 3 runs of
    1000 rounds lived. A task ``ray.wait`` reports ended is never cancelled."""
    import ray

    if not refs:
        return
    try:
        _, running = ray.wait(list(refs), num_returns=len(refs), timeout=grace_s)
        for ref in running:
            ray.cancel(ref, force=True)
    except Exception:  # Ray already gone (the driver is stopping): nothing left to end
        pass
