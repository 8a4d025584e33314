"""A process's share of a GPU: which device it trains on, how much of its card's memory it may take,
which process-group backend its gang uses, and what it reports of the GPU afterwards.

Ray hands out shares of a card: two ranks at ``gpus_per_worker: 0.5`` may both be told ``CUDA_VISIBLE_DEVICES=0``
(the same physical GPU). NCCL refuses two ranks of one group on one device ("Duplicate GPU detected"), and
nothing stops one share from allocating the whole card. So a gang of shares uses gloo (it all-reduces CUDA tensors
too, through the host), and each process is fenced to its share of the card's memory
(``torch.cuda.set_per_process_memory_fraction``) before its model is built: an allocation beyond it fails in that
process, with its own limit named, and never takes a neighbour's memory.

A job that asks for no GPU is not shown any (the service sets ``CUDA_VISIBLE_DEVICES=""`` in its Ray job:
``service.launch.ray_cluster.gpu_env``; Ray 2.60 no longer does for a process given 0 GPUs).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
from collections.abc import Callable, Iterator
from typing import Any

import torch

from api_schemas import ExperimentSpec
from api_schemas.spec import GIB, ResourcesSpec
from workers.train.failure import JobFailed

MIB = float(1 << 20)
SumRanks = Callable[[list[float]], list[float]]  # a sum over the ranks, elementwise (``RunContext.all_reduce_sum``)


def job_device(spec: ExperimentSpec) -> torch.device:
    """The device one process of the job trains on: the CPU without GPUs (or with ``training.device=cpu``: the
    share is held and the CPU trains, as on a CPU box whose Ray head only advertises GPUs), else the GPU Ray
    made visible (``CUDA_VISIBLE_DEVICES`` of a process given GPUs names its own, first)."""
    r, wanted = spec.resources, spec.training.device
    if r.gpus_per_worker <= 0 or wanted == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"resources.gpus_per_worker={r.gpus_per_worker:g} but no CUDA device is visible to this "
                         "process: submit through the scheduler (it asks Ray for the GPU), set gpus_per_worker=0, "
                         "or set training.device=cpu to hold the share and train on the CPU")
    return torch.device("cuda", 0)


def claim_device(spec: ExperimentSpec) -> torch.device:
    """``job_device``, with this process's share of the card's memory fenced (``fence_memory``): call it before
    the model is built."""
    device = job_device(spec)
    fence_memory(spec.resources, device)
    return device


def process_group_backend(resources: ResourcesSpec, device: torch.device) -> str:
    """``nccl`` only when each rank trains on CUDA with whole GPUs of its own (``gpus_per_worker >= 1``: Ray never
    gives one whole GPU to two processes); ``gloo`` otherwise, on the CPU and for shares of a card, where two ranks
    of the job may be given the same one."""
    return "nccl" if device.type == "cuda" and resources.gpus_per_worker >= 1 else "gloo"


def memory_fraction(resources: ResourcesSpec, total_bytes: int) -> float | None:
    """The share of a card of ``total_bytes`` one process may allocate: ``gpu_memory_gb`` of it when set (within
    ``gpus_per_worker`` when that is below 1: Ray packs shares onto a card, so more memory than the share could be
    another job's), else ``gpus_per_worker`` when below 1 (four trials at 0.25: a quarter each); None for whole GPUs
    (no fence).

    >>> memory_fraction(ResourcesSpec(gpus_per_worker=0.25), 80 << 30)
    0.25
    """
    share = resources.gpus_per_worker
    if resources.gpu_memory_gb is not None:
        fraction = resources.gpu_memory_gb * GIB / total_bytes
        if fraction > 1:
            raise ValueError(f"resources.gpu_memory_gb={resources.gpu_memory_gb:g} but this GPU has "
                             f"{total_bytes / GIB:.1f} GiB: lower gpu_memory_gb")
        if 0 < share < 1 and fraction > share + 1e-9:  # Ray packs shares, not memory: the rest may be others'
            raise ValueError(f"resources.gpu_memory_gb={resources.gpu_memory_gb:g} is more than this process's "
                             f"share of its {total_bytes / GIB:.1f}-GiB card (gpus_per_worker={share:g}: "
                             f"{share * total_bytes / GIB:.1f} GiB), whose rest Ray may give other jobs: raise "
                             f"gpus_per_worker to {math.ceil(fraction * 100) / 100:g} or lower gpu_memory_gb")
        return fraction
    return share if 0 < share < 1 else None


def fence_memory(resources: ResourcesSpec, device: torch.device) -> float | None:
    """Fence this process to ``memory_fraction`` of ``device``'s memory (CUDA only): the fraction set, or None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    fraction = memory_fraction(resources, torch.cuda.get_device_properties(index).total_memory)
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def fence_text(resources: ResourcesSpec) -> str:
    """The fence a process of this job has, as the field that sets it."""
    if resources.gpu_memory_gb is not None:
        return f"resources.gpu_memory_gb={resources.gpu_memory_gb:g}"
    return f"resources.gpus_per_worker={resources.gpus_per_worker:g} of the card"


@contextlib.contextmanager
def oom_named(resources: ResourcesSpec) -> Iterator[None]:
    """A CUDA out-of-memory error in the block fails the job (no retry: it would run out again) naming the fence
    that set this process's limit."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        first = str(err).split("\n", 1)[0]
        raise JobFailed(f"out of GPU memory within this process's share ({fence_text(resources)}): raise "
                        f"resources.gpu_memory_gb or gpus_per_worker, or lower training.batch_size (raise "
                        f"training.grad_accumulation to keep the step's batch) ({first})") from err


def gpu_memory(device: torch.device, sum_ranks: SumRanks | None = None, rank: int = 0,
               world_size: int = 1) -> dict[str, Any]:
    """On CUDA, the process's tensors' peak memory so far in MiB, as ``{"gpu_memory_mb": ...}`` ({} elsewhere):
    every epoch record carries it, so the cluster view and a job's page show it while the job runs. With several
    ranks and ``sum_ranks`` (their all-reduce; every rank calls this), also ``gpu_memory_mb_ranks``: each rank's,
    in rank order, so the cluster view puts each rank's memory on its own node; ``gpu_memory_mb`` is rank 0's."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    mine = round(torch.cuda.max_memory_allocated(device) / MIB, 1)
    if sum_ranks is None or world_size == 1:
        return {"gpu_memory_mb": mine}
    ranks = each_rank(mine, rank, world_size, sum_ranks)
    return {"gpu_memory_mb": ranks[0], "gpu_memory_mb_ranks": ranks}


def each_rank(value: float, rank: int, world_size: int, sum_ranks: SumRanks) -> list[float]:
    """Every rank's ``value``, in rank order, on every rank: one all-reduce of a vector holding each its own."""
    return [round(v, 1) for v in sum_ranks([value if r == rank else 0.0 for r in range(world_size)])]


def device_report(device: torch.device) -> dict[str, Any]:
    """What a job's summary says of its device: the device, the GPUs Ray let the process see
    (``CUDA_VISIBLE_DEVICES``; None when unset), the process's peak resident set in MiB (a guide for
    ``resources.memory_gb``; a DataLoader's workers not counted), and on CUDA its tensors' peak memory."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # (Linux counts KiB)
    report: dict[str, Any] = {"device": str(device), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                              "host_memory_peak_mb": round(peak_kib / 1024, 1)}
    if peak := gpu_memory(device):
        report["gpu_memory_peak_mb"] = peak["gpu_memory_mb"]
    return report
