"""A process's share of a GPU (``workers.train.gpu_share``): the memory fence's fraction, the process group's backend,
the device a job trains on, and what its summary says of it. On the CPU: the fence's call is guarded, its
computation is tested here; on a CUDA machine the fence is also applied and read back."""

from __future__ import annotations

import pytest
import torch

from api_schemas import ExperimentSpec
from api_schemas.spec import ResourcesSpec
from workers.train.failure import JobFailed
from workers.train.gpu_share import (
    GIB,
    device_report,
    each_rank,
    fence_memory,
    gpu_memory,
    job_device,
    memory_fraction,
    oom_named,
    process_group_backend,
)

CARD = int(80 * GIB)  # an H100's 80 GiB
CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


@pytest.mark.parametrize(("resources", "fraction"), [
    ({"gpus_per_worker": 0.25}, 0.25),  # four sweep trials on one card: a quarter each
    ({"gpus_per_worker": 0.5}, 0.5),
    ({"gpus_per_worker": 1}, None),  # whole GPUs: no fence
    ({"gpus_per_worker": 2}, None),
    ({"gpus_per_worker": 0.5, "gpu_memory_gb": 20}, 0.25),  # an explicit limit wins over the share
    ({"gpus_per_worker": 1, "gpu_memory_gb": 60}, 0.75),
])
def test_the_fence_is_the_share_of_the_card_or_the_explicit_limit(resources: dict, fraction: float | None) -> None:
    assert memory_fraction(ResourcesSpec(**resources), CARD) == fraction


def test_a_limit_above_the_card_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"resources.gpu_memory_gb=100 but this GPU has 80.0 GiB"):
        memory_fraction(ResourcesSpec(gpus_per_worker=1, gpu_memory_gb=100), CARD)


def test_a_limit_above_the_share_is_refused_naming_the_share_to_ask() -> None:
    # two jobs at 0.25 with 60 GiB each: Ray may pack both onto one 80-GiB card, and the second would run out
    with pytest.raises(ValueError, match=r"resources.gpu_memory_gb=60 is more than this process's share of its "
                                         r"80.0-GiB card \(gpus_per_worker=0.25: 20.0 GiB\), whose rest Ray may give "
                                         r"other jobs: raise gpus_per_worker to 0.75 or lower gpu_memory_gb"):
        memory_fraction(ResourcesSpec(gpus_per_worker=0.25, gpu_memory_gb=60), CARD)
    assert memory_fraction(ResourcesSpec(gpus_per_worker=0.25, gpu_memory_gb=20), CARD) == 0.25  # the share itself


@pytest.mark.parametrize(("share", "device", "backend"), [
    (0.5, CUDA, "gloo"),  # two ranks may be given the same card: NCCL would refuse ("Duplicate GPU detected")
    (0.25, CUDA, "gloo"),
    (1, CUDA, "nccl"),  # whole distinct GPUs
    (2, CUDA, "nccl"),
    (1, torch.device("cpu"), "gloo"),  # a share held, the CPU training (training.device=cpu)
    (0, torch.device("cpu"), "gloo"),
])
def test_the_backend_follows_the_placement(share: float, device: torch.device, backend: str) -> None:
    assert process_group_backend(ResourcesSpec(gpus_per_worker=share), device) == backend


def spec(**resources: object) -> ExperimentSpec:
    device = resources.pop("device", "auto")
    return ExperimentSpec.model_validate({"resources": resources, "training": {"device": device}})


def test_a_job_without_gpus_or_told_cpu_trains_on_the_cpu() -> None:
    assert job_device(spec()) == torch.device("cpu")
    assert job_device(spec(gpus_per_worker=0.5, device="cpu")) == torch.device("cpu")  # the share held only


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_share_with_no_visible_gpu_fails_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"resources.gpus_per_worker=0.5 but no CUDA device is visible"):
        job_device(spec(gpus_per_worker=0.5))


def test_the_fence_is_not_applied_off_cuda() -> None:
    assert fence_memory(ResourcesSpec(gpus_per_worker=0.25), torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_fence_limits_this_process() -> None:
    resources = ResourcesSpec(gpus_per_worker=1, gpu_memory_gb=1)
    fraction = fence_memory(resources, CUDA)
    assert fraction == pytest.approx(GIB / torch.cuda.get_device_properties(0).total_memory)
    torch.cuda.reset_peak_memory_stats(CUDA)
    held = torch.empty(256 * 2**20, dtype=torch.uint8, device=CUDA)  # 256 MiB, within the fence
    with pytest.raises(JobFailed, match=r"resources.gpu_memory_gb=1\)"), oom_named(resources):
        torch.empty(int(1.5 * GIB), dtype=torch.uint8, device=CUDA)  # over its 1 GiB, though the card has room
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert 256 <= device_report(CUDA)["gpu_memory_peak_mb"] < 1024, device_report(CUDA)  # what it held, not the refused
    del held


def test_out_of_memory_fails_the_job_naming_its_own_limit() -> None:
    with pytest.raises(JobFailed, match=r"share \(resources.gpus_per_worker=0.25 of the card\): raise"):
        with oom_named(ResourcesSpec(gpus_per_worker=0.25)):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")


def test_the_summary_says_the_device_and_the_gpus_the_process_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    report = device_report(torch.device("cpu"))
    peak = report.pop("host_memory_peak_mb")
    assert report == {"device": "cpu", "cuda_visible_devices": ""}
    assert peak >= psutil.Process().memory_info().rss / 2**20 - 1  # its peak resident set, in MiB: at least now's
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert device_report(torch.device("cpu"))["cuda_visible_devices"] is None


def test_off_cuda_an_epoch_carries_no_gpu_memory() -> None:
    assert gpu_memory(torch.device("cpu")) == {}
    assert gpu_memory(torch.device("cpu"), lambda v: v, rank=1, world_size=2) == {}  # no collective either


def test_every_rank_learns_each_ranks_memory_in_rank_order() -> None:
    """The all-reduce the ranks join, played out: each rank's vector holds its own value only; summed, every rank
    reads all of them."""
    values = [640.04, 598.5, 12.0]
    vectors: list[list[float]] = []
    for rank, value in enumerate(values):
        each_rank(value, rank, 3, lambda v: vectors.append(v) or v)
    assert vectors[2] == [0.0, 0.0, 12.0]
    total = [sum(column) for column in zip(*vectors, strict=True)]
    assert each_rank(values[1], 1, 3, lambda v: total) == [640.0, 598.5, 12.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_every_epoch_reports_the_gpu_memory_so_far_and_the_summary_its_peak() -> None:
    """What the cluster view and a job's page show while it runs (``service.scheduler.cluster_view.gpu_memory``)."""
    from workers.train.context import RunContext
    from workers.train.loop import train
    from workers.train.sinks import MemorySink

    spec = ExperimentSpec.model_validate({"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [64]},
                                          "training": {"epochs": 2, "device": "cuda"}})
    sink = MemorySink()
    summary = train(spec, RunContext(device=torch.device("cuda"), sink=sink))
    memory = [r["gpu_memory_mb"] for r in sink.records if r["kind"] == "epoch"]
    assert len(memory) == 2 and 0 < memory[0] <= memory[1] <= summary["gpu_memory_peak_mb"], (memory, summary)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts a CUDA device's host syncs")
def test_a_cuda_training_step_does_not_make_the_host_wait() -> None:
    # CUDA's sync debug mode warns at each host sync: an epoch of 20 steps syncs as often as one of 5 (the epoch's
    # loss read, its evaluation), so a step syncs never: its batch comes pinned and is copied without waiting
    import warnings

    from api_schemas import build_spec
    from workers.train.context import RunContext
    from workers.train.loop import train

    def syncs(steps: int) -> int:
        spec = build_spec({"model": {"kind": "mlp", "hidden": [32]}, "optimizer": {"name": "sgd", "lr": 0.1},
                           "dataset": {"name": "digits", "max_train": 400, "max_test": 100},
                           "training": {"epochs": 1, "batch_size": 16, "max_steps_per_epoch": steps,
                                        "device": "cuda", "grad_clip_norm": 1.0},
                           "teleport": {"enabled": False}})
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                train(spec, RunContext(device=torch.device("cuda")), threads=1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in seen)

    syncs(5)  # warm: CUDA's and the allocator's first calls
    assert syncs(20) == syncs(5)
