"""Who runs ``compute_basis`` over a teleport batch's representations: in turn, on a thread pool, or (workers) Ray
tasks; ``teleport.teleporter.layer_bases`` batches them by shape instead when that pays (a GPU, the serial case)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")
U = TypeVar("U")


class BasisExecutor(Protocol):
    """Runs ``compute_basis`` over every layer's R; workers plug in Ray tasks or a GPU batch."""

    def map(self, fn: Callable[[T], U], items: Sequence[T]) -> list[U]: ...


class SerialExecutor:
    """One layer after another, in this process (the default)."""

    def map(self, fn: Callable[[T], U], items: Sequence[T]) -> list[U]:
        return [fn(item) for item in items]


class ThreadExecutor:
    """Layers on a thread pool: torch's SVD/eigh release the GIL.

    Each decomposition runs single-threaded while the pool is busy (torch's thread count is
    process-wide): k BLAS-threaded SVDs on k cores oversubscribe them and run 10-20x slower.
    Representations on a GPU are decomposed one after another in the calling thread: the device runs
    them in turn anyway, and a pool thread has no current CUDA context (cuBLAS warns and sets one up).
    """

    def __init__(self, max_workers: int | None = None) -> None:
        self.max_workers = max_workers  # None: torch's thread budget of this process (a worker's CPUs)

    def map(self, fn: Callable[[T], U], items: Sequence[T]) -> list[U]:
        threads = torch.get_num_threads()
        workers = self.max_workers or threads
        on_gpu = any(isinstance(item, Tensor) and item.device.type != "cpu" for item in items)
        if len(items) <= 1 or workers <= 1 or on_gpu:
            return [fn(item) for item in items]
        try:  # OpenMP's thread count is per calling thread: set it in each pool thread too
            with ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
                return list(pool.map(fn, items))
        finally:
            torch.set_num_threads(threads)
