"""A multi-worker job trains as a gang its driver leads: rank 0 in the Ray job's driver (as a 1-worker job does,
``workers.on_ray.driver``), ranks 1..N-1 as Ray tasks on the nodes the scheduler planned (``workers.on_ray.gang_start``:
started before the driver imports torch), all joined in one ``torch.distributed`` process group over a TCP store the
driver opens. No Ray Train controller, worker group or polling: a 2-worker TorchTrainer took ~9 s here from ``fit()`` to
its loop, most of a job's start.

What Ray Train did for the gang, done here: DDP and sharded loaders (``RunContext`` with ``world_size > 1``),
checkpoints written by rank 0 only (``DriverContext.save``, in Ray Train's layout), every rank resuming from
the newest one, a failed rank failing the whole try (its process group closes, the others' collectives raise)
and the try retried from the last checkpoint (``run_in_driver``). ``TLAB_IN_DRIVER=0`` keeps the TorchTrainer.

A job of the service trains each rank in its sandbox: rank 0's payload and each other rank's (started by
the rank's Ray task, ``workers.on_ray.supervisor``) use ``join`` and ``GangContext`` from here; ``lead`` stays the
in-process path (``run_in_driver``: tests, benchmarks), whose other ranks are sandboxed the same way.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from api_schemas import ExperimentSpec
from teleport.distributed import Collective, TorchDistributed
from workers.on_ray.driver import DriverContext, attempt
from workers.on_ray.gang_start import Ranks
from workers.train.gpu_share import process_group_backend
from workers.train.sinks import MetricSink
from workers.train.startup import mark


def timeout() -> timedelta:
    """How long a rank waits for the others (joining, or at a collective): ``TLAB_GANG_TIMEOUT_S``, 300 s: a rank
    whose peer went silent (a host cut off) fails within minutes, not Ray Train's 30. A rank that dies closes its
    connections, and the others fail at once, not after this."""
    return timedelta(seconds=float(os.environ.get("TLAB_GANG_TIMEOUT_S", "300")))


class GangContext(DriverContext):
    """One rank of a driver-led gang: the model DDP-wrapped over the gang's process group; rank 0 alone writes
    checkpoints (and, through its sink, metrics); every rank restores the newest one."""

    def __init__(self, sink: MetricSink, run_dir: str | Path, *, rank: int, world_size: int, device: torch.device,
                 artifacts_dir: str | Path | None = None, start_from: Path | None = None, **fencing: Any) -> None:
        """``fencing``: ``attempt`` and ``fence``, as ``DriverContext`` takes them (rank 0 writes checkpoints)."""
        super().__init__(sink, run_dir, device=device, artifacts_dir=artifacts_dir, start_from=start_from,
                         rank=rank, world_size=world_size, **fencing)
        self._comm = TorchDistributed()

    @property
    def comm(self) -> Collective | None:
        return self._comm

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        return nn.parallel.DistributedDataParallel(model, device_ids=[self.device.index]
                                                   if self.device.type == "cuda" else None)

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        if self.is_chief:
            super().save(state, metrics)

    def restore(self) -> dict[str, Any] | None:
        state = super().restore()
        dist.barrier()  # every rank has read it before rank 0 can write (and rotate) the next
        return state


REACH_S = 15.0  # how long a rank tries to reach rank 0's store before it fails the try with one line


def reach(host: str, port: int, rank: int, within_s: float | None = None) -> None:
    """Fail in seconds, naming both ends, when this rank cannot open a connection to rank 0's store (a firewall, no
    route between the hosts, an address only rank 0's host can use) instead of after ``TLAB_GANG_TIMEOUT_S``. The
    store's socket listens before any other rank starts, so a connection opens at once where the network allows."""
    within_s = REACH_S if within_s is None else within_s
    deadline, err = time.monotonic() + within_s, ""
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.5, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError as e:
            err = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise ConnectionError(f"rank {rank} on {socket.gethostname()} cannot reach rank 0 at {host}:{port} "
                                  f"within {within_s:g} s ({err}): the hosts must reach each other on their nodes' "
                                  "addresses, on any port (a firewall between them?)")
        time.sleep(0.2)


def said(message: str) -> None:
    print(f"[tlab] {message}", file=sys.stderr, flush=True)  # the job's log


def join(host: str, port: int, rank: int, spec: ExperimentSpec, device: torch.device, store: Any = None) -> str:
    """Join the gang's process group (rank 0 passes the store it opened; the others connect to it and say so) on
    the backend its placement allows (``process_group_backend``: gloo where ranks may share a card); says which."""
    world, backend = spec.resources.workers, process_group_backend(spec.resources, device)
    if store is None:
        reach(host, port, rank)
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout())
        store.set(f"joined/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout())
    said(f"rank {rank} of {world} joined on {backend} ({device}; resources.gpus_per_worker="
         f"{spec.resources.gpus_per_worker:g}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return backend


def await_ranks(store: Any, ranks: Ranks) -> None:
    """Rank 0 waits until every other rank has reached the store, watching their tasks meanwhile: one that ended
    before it joined (its runtime env or node failed, its code raised) fails this try at once, not after
    ``TLAB_GANG_TIMEOUT_S``."""
    names = [f"joined/{k}" for k in range(1, ranks.world)]
    deadline = time.monotonic() + timeout().total_seconds()
    while not store.check(names):
        ranks.raise_if_ended(wait_s=0.2)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gang's other ranks did not start within TLAB_GANG_TIMEOUT_S="
                               f"{timeout().total_seconds():g} s (are their nodes' resources free?)")


def lead(spec: ExperimentSpec, job_id: str, redis_url: str, storage: str | Path, sink: MetricSink,
         device: torch.device, artifacts: str | Path | None = None, start_from: Path | None = None,
         placement: Sequence[str] = (), ranks: Ranks | None = None) -> dict[str, Any]:
    """One try of the gang: ranks 1..N-1 (``ranks`` if the driver started them already, else started now with the
    ``start_from`` it decided), rank 0 trained here; the summary once every rank is done."""
    t0 = time.perf_counter()
    ranks = ranks or Ranks(spec, job_id, redis_url, storage, placement, artifacts, start_from)
    world = ranks.world
    try:
        store = dist.TCPStore(ranks.host, ranks.port, world, is_master=True, timeout=timeout(),
                              wait_for_workers=False, master_listen_fd=ranks.sock.detach())  # the store owns it
        await_ranks(store, ranks)
        backend = join(ranks.host, ranks.port, 0, spec, device, store)
        mark("group")
        said(f"gang of {world} on {backend}: every rank joined ({time.perf_counter() - t0:.1f} s after rank 0 was "
             "ready)")
        summary = attempt(spec, GangContext(sink, Path(storage) / job_id, rank=0, world_size=world, device=device,
                                            artifacts_dir=artifacts, start_from=start_from))
        ranks.wait()  # a rank's own error surfaces here
        return summary
    finally:
        ranks.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
