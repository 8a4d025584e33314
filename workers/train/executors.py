"""Where each layer's basis is computed: in process (serial, threads) or as Ray tasks.

Measured by benchmarks/parallel_bases.py on 2 cores (results/parallel_bases.json): threads with
one BLAS thread each beat serial (2 BLAS threads on one SVD) by 1.3-2.3x once there are several
layers of ≥ 256×256; Ray tasks on the same node lose to threads (process hop, copies), and only
add cores the process does not have, i.e. on a multi-node cluster. A Ray task round
trip is ~1.5 ms and numpy arrays travel near zero-copy (torch tensors are copied), so the Ray
executor ships numpy arrays. ``auto`` picks per call from the layers' estimated work.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from teleport import BasisExecutor, SerialExecutor, ThreadExecutor

T = TypeVar("T")
U = TypeVar("U")

# Estimated work (d·N² or d²·N + d³) from which a layer is worth a thread or a Ray task of its own.
# benchmarks/results/parallel_bases.json: threads beat serial from 4 layers of 256×256 (1.7e7, ~4 ms
# each) up, by 1.7-2.3x at 1024-4096 wide; two 256×256 layers tie. Far smaller layers stay serial.
PARALLEL_MIN_WORK = 4e6


def basis_work(rep: Tensor) -> float:
    """Rough flop count of one layer's decomposition, by the route compute_basis takes."""
    d, n = rep.shape
    return float(d * n * n) if n < d else float(d * d * n + d**3)


def _to_numpy(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu().numpy()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to_numpy(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    return obj


def _to_torch(obj: Any, device: torch.device | None = None) -> Any:
    if isinstance(obj, np.ndarray):
        t = torch.from_numpy(np.array(obj))  # the object store hands out read-only views: copy once
        return t if device is None else t.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _to_torch(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        )
    return obj


def _run_on_numpy(fn: Callable[[Tensor], Any], array: np.ndarray) -> Any:
    torch.set_num_threads(1)  # one task per core: BLAS threads would fight each other
    return _to_numpy(fn(_to_torch(array)))


class RayTaskExecutor:
    """Each item (a representation R) as one Ray task: numpy in, numpy out, tensors on the driver.

    ``min_work``: items whose estimated work is below it stay in this process (0 sends all).
    """

    def __init__(self, min_work: float = 0.0, num_cpus: float = 1.0) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("teleport.parallel=ray needs a Ray cluster: call ray.init() or set RAY_ADDRESS")
        self._ray = ray
        self._task = ray.remote(num_cpus=num_cpus)(_run_on_numpy)
        self.min_work = min_work

    def map(self, fn: Callable[[T], U], items: Sequence[T]) -> list[U]:
        remote = {i: self._task.remote(fn, _to_numpy(item)) for i, item in enumerate(items)
                  if basis_work(item) >= self.min_work}  # type: ignore[arg-type]
        local = {i: fn(item) for i, item in enumerate(items) if i not in remote}  # runs while tasks fly
        device = items[0].device if items else None  # type: ignore[attr-defined]
        fetched = dict(zip(remote, self._ray.get(list(remote.values())), strict=True))
        return [local[i] if i in local else _to_torch(fetched[i], device) for i in range(len(items))]


def _cluster_cpus() -> float:
    import ray

    return float(ray.cluster_resources().get("CPU", 0)) if ray.is_initialized() else 0.0


class AutoExecutor:
    """Per call: serial unless two or more layers are big enough to share out; then Ray tasks when
    the Ray cluster has more CPUs than this machine (other nodes), else threads here."""

    def __init__(self) -> None:
        self.serial = SerialExecutor()
        self.threads = ThreadExecutor()  # as many as this process's CPU budget (torch's thread count)
        self.ray: RayTaskExecutor | None = None

    def choose(self, items: Sequence[Tensor]) -> BasisExecutor:
        if sum(basis_work(item) >= PARALLEL_MIN_WORK for item in items) < 2:
            return self.serial
        if _cluster_cpus() > (os.cpu_count() or 1):
            self.ray = self.ray or RayTaskExecutor(min_work=PARALLEL_MIN_WORK)
            return self.ray
        return self.threads

    def map(self, fn: Callable[[T], U], items: Sequence[T]) -> list[U]:
        return self.choose(items).map(fn, items)  # type: ignore[arg-type]


def make_executor(name: str) -> BasisExecutor:
    """``teleport.parallel`` of the spec -> an executor."""
    if name == "serial":
        return SerialExecutor()
    if name == "threads":
        return ThreadExecutor()
    if name == "ray":
        return RayTaskExecutor(min_work=0.0)
    if name == "auto":
        return AutoExecutor()
    raise ValueError(f"teleport.parallel={name!r}: use one of auto, serial, threads, ray")
