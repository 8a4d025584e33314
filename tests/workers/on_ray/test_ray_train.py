"""Ray Train DDP on a real local Ray cluster and a real Redis: training, distributed teleport, recovery."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from api_schemas import build_spec
from workers.job.redis_sink import read_events
from workers.on_ray.ray_train import build_trainer

pytestmark = pytest.mark.slow

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")  # DESIGN: 30 s -> 14 s for tiny runs


def tiny_spec(model: dict, epochs: int = 3, **teleport: object) -> object:
    return build_spec({
        "model": model,
        "dataset": {"name": "digits", "max_train": 256, "max_test": 128},
        "optimizer": {"name": "sgd", "lr": 0.05},
        "training": {"epochs": epochs, "batch_size": 32, "seed": 0},
        "teleport": {"epochs": [0, 1], "batches": 2, "steps": 2, "batch_size": 16, "lr": 0.1, "cap": 50.0,
                     "budget": None, **teleport},
        "resources": {"workers": 2, "cpus_per_worker": 0.5},
    })


def metric_epochs(redis_url: str, job: str) -> list[dict]:
    return [e["data"] for e in read_events(redis_url, job) if e["kind"] == "metric"]


@pytest.mark.parametrize("model", [{"kind": "mlp", "hidden": [32, 32]}, {"kind": "cnn", "channels": [8, 16]}])
def test_two_worker_ddp_trains_with_a_complete_ordered_stream(
    ray_local: object, redis_server: str, tmp_path: Path, model: dict
) -> None:
    spec = tiny_spec(model)
    job = f"ddp-{model['kind']}"
    result = build_trainer(spec, name=job, storage_path=tmp_path, redis_url=redis_server, job_id=job).fit()
    assert result.error is None
    epochs = metric_epochs(redis_server, job)
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    teleports = [e["data"] for e in read_events(redis_server, job) if e["kind"] == "teleport"]
    assert [(t["epoch"], t["batch"]) for t in teleports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert result.checkpoint is not None


def _teleport_on_ranks(config: dict) -> None:
    """A Ray Train worker: teleport its shard of one batch, then compare parameters across ranks."""
    import ray.train
    import torch.distributed as dist

    from teleport import TeleportConfig, teleport_batch
    from teleport.distributed import TorchDistributed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()
    x, y = torch.randn(10, 12, dtype=torch.float64), torch.randint(0, 4, (10,))
    rank = ray.train.get_context().get_world_rank()
    idx = torch.tensor_split(torch.arange(10), 2)[rank]
    report = teleport_batch(model, F.cross_entropy, x[idx], y[idx], TeleportConfig(steps=3, lr=0.3, cap=1e6),
                            comm=TorchDistributed())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    with torch.no_grad():
        whole_loss = float(F.cross_entropy(model(x), y))
    metrics = {"max_abs_diff": float((gathered[0] - gathered[1]).abs().max()), "steps": report.steps,
               "loss_before": report.loss_before, "loss_after": report.loss_after,
               "whole_loss": whole_loss, "params": flat.tolist()}
    with tempfile.TemporaryDirectory() as tmp:  # Ray Train 2.60 keeps the metrics of checkpointed reports
        Path(tmp, "done").write_text("1")
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp) if rank == 0 else None)


def _report_then_flush(config: dict) -> None:
    """Report a few results as fast as possible, then hand the last one over (``flush_reports``)."""
    import ray.train
    from ray.train.v2._internal.execution.context import get_train_context

    from workers.on_ray.ray_train import flush_reports

    rank = ray.train.get_context().get_world_rank()
    for i in range(config["reports"]):  # rank 0 attaches a checkpoint: Ray Train's result is the latest one's
        with tempfile.TemporaryDirectory() as d:
            Path(d, "i").write_text(str(i))
            ray.train.report({"i": i}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
    flush_reports()
    left = get_train_context().get_result_queue().unfinished_tasks
    Path(config["out"], f"rank{rank}").write_text(str(left))


def test_a_workers_last_report_is_taken_before_its_function_returns(ray_local: object, tmp_path: Path) -> None:
    # Ray Train's poll takes a report, then asks whether the thread still runs: a last report put in between by
    # a thread that then returns was lost (the run's result one epoch short). flush_reports waits until the
    # controller took it, so nothing is left on the queue when the function ends, and the result is the last.
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(_report_then_flush, train_loop_config={"reports": 4, "out": str(tmp_path)},
                           scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                           run_config=RunConfig(name="flush", storage_path=str(tmp_path / "runs")))
    result = trainer.fit()
    assert result.error is None and result.metrics["i"] == 3
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["0", "0"]


def test_distributed_teleport_in_ray_train_keeps_replicas_bit_identical(ray_local: object, tmp_path: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from teleport import TeleportConfig, teleport_batch

    trainer = TorchTrainer(_teleport_on_ranks, scaling_config=ScalingConfig(num_workers=2,
                                                                            resources_per_worker={"CPU": 0.5}),
                           run_config=RunConfig(name="tele", storage_path=str(tmp_path)))
    m = trainer.fit().metrics
    assert m["max_abs_diff"] == 0.0 and m["steps"] == 3
    assert abs(m["loss_after"] - m["loss_before"]) <= 1e-9 * m["loss_before"]
    assert m["whole_loss"] == pytest.approx(m["loss_before"], rel=1e-12)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()
    x, y = torch.randn(10, 12, dtype=torch.float64), torch.randint(0, 4, (10,))
    teleport_batch(model, F.cross_entropy, x, y, TeleportConfig(steps=3, lr=0.3, cap=1e6))
    single = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.allclose(torch.tensor(m["params"], dtype=torch.float64), single, atol=1e-10)


@pytest.mark.drill
def test_killed_worker_resumes_from_checkpoint_with_every_epoch_once(
    ray_local: object, redis_server: str, tmp_path: Path
) -> None:
    spec = tiny_spec({"kind": "mlp", "hidden": [64, 64]}, epochs=8)
    job = "kill"
    pids = tmp_path / "pids"
    pids.mkdir()
    trainer = build_trainer(spec, name=job, storage_path=tmp_path / "storage", redis_url=redis_server, job_id=job,
                            pid_dir=pids, max_failures=2)
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.setdefault("result", trainer.fit()))
    runner.start()
    deadline = time.monotonic() + 120
    while len(metric_epochs(redis_server, job)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = int((pids / "rank1.pid").read_text())
    os.kill(victim, signal.SIGKILL)
    runner.join(timeout=240)
    assert not runner.is_alive()
    assert outcome["result"].error is None
    assert int((pids / "rank1.pid").read_text()) != victim  # a new worker process took over
    assert [e["epoch"] for e in metric_epochs(redis_server, job)] == list(range(8))



def test_a_gang_of_card_shares_asks_ray_train_for_gloo_and_the_gpu_model() -> None:
    from api_schemas import ExperimentSpec
    from workers.on_ray.gang_start import rank_options
    from workers.on_ray.ray_train import scaling_config, torch_config

    shares = ExperimentSpec.model_validate({"resources": {"workers": 2, "gpus_per_worker": 0.5, "gpu_type": "H100"}})
    whole = ExperimentSpec.model_validate({"resources": {"workers": 2, "gpus_per_worker": 1}})
    assert torch_config(shares).backend == "gloo" and torch_config(whole).backend == "nccl"
    assert scaling_config(shares).resources_per_worker == {"CPU": 1, "GPU": 0.5, "accelerator_type:H100": 0.001}
    assert rank_options(shares, None)["accelerator_type"] == "H100"  # a gang's other ranks: the same model
    # resources.memory_gb: each Ray Train worker reserves it (bytes), as the driver and a gang's ranks do
    held = ExperimentSpec.model_validate({"resources": {"workers": 2, "memory_gb": 0.5}})
    assert scaling_config(held).resources_per_worker == {"CPU": 1, "memory": 2**29}
    assert rank_options(held, None)["memory"] == 2**29
