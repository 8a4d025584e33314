"""Where each layer's basis is computed: in process (serial, threads) or as Ray tasks.

DESIGN.md measured on 2 cores: a Ray task round trip is ~1.5 ms, numpy arrays travel near
zero-copy while torch tensors are copied, and a per-layer SVD pays for a task only above about
40 ms of work (≈ a 4096×256 thin SVD). So the Ray executor ships numpy arrays, and ``auto``
sends a layer to Ray only when its estimated work is above that line; the rest run here while
the tasks are in flight.
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

# d·N² (thin SVD) or d²·N + d³ (Gram + eigh) of a 4096×256 layer: ~40 ms here, the Ray break-even
RAY_MIN_WORK = 4096 * 256 * 256


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


def make_executor(name: str) -> BasisExecutor:
    """``teleport.parallel`` of the spec -> an executor. ``auto``: Ray tasks for big layers when a
    Ray cluster is up in this process, else serial (threads only help with free cores)."""
    if name == "serial":
        return SerialExecutor()
    if name == "threads":
        return ThreadExecutor(max_workers=os.cpu_count())
    if name == "ray":
        return RayTaskExecutor(min_work=0.0)
    if name == "auto":
        import ray

        return RayTaskExecutor(min_work=RAY_MIN_WORK) if ray.is_initialized() else SerialExecutor()
    raise ValueError(f"teleport.parallel={name!r}: use one of auto, serial, threads, ray")
