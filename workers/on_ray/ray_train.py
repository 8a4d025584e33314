"""The spec as a Ray Train TorchTrainer: N DDP workers running the same loop as ``tlab run --local``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from api_schemas import ExperimentSpec
from api_schemas.spec import ray_memory
from workers.train.context import keep_checkpoints
from workers.train.sinks import JsonlSink, MetricSink, NullSink


def scaling_config(spec: ExperimentSpec) -> ScalingConfig:
    """The gang: ``resources.workers`` ranks, each with its CPUs, (fractional) GPUs and memory, training on them (Ray
    Train refuses a GPU held and not used: ``training.device=cpu`` with a share is for the driver-led path only)."""
    r = spec.resources
    per_worker: dict[str, float] = {"CPU": r.cpus_per_worker}
    if r.gpus_per_worker > 0:
        per_worker["GPU"] = r.gpus_per_worker
    if r.memory_gb:
        per_worker["memory"] = ray_memory(r.memory_gb)
    if r.gpu_type:
        per_worker[f"accelerator_type:{r.gpu_type}"] = 0.001  # what Ray's own accelerator_type= option asks
    return ScalingConfig(num_workers=r.workers, use_gpu=r.gpus_per_worker > 0, resources_per_worker=per_worker)


def torch_config(spec: ExperimentSpec) -> TorchConfig:
    """The gang's process group: gloo where its ranks may share a card (``workers.train.gpu_share``)."""
    from workers.train.gpu_share import process_group_backend

    device = torch.device("cuda" if scaling_config(spec).use_gpu else "cpu")
    return TorchConfig(backend=process_group_backend(spec.resources, device))


def _worker_sink(config: dict[str, Any], rank: int) -> MetricSink:
    """Rank 0 writes the metrics (to the job's Redis stream, or to DIR/metrics.jsonl); the others don't."""
    if rank != 0:
        return NullSink()
    if config.get("redis_url"):
        from workers.job.redis_sink import RedisSink

        return RedisSink(config["redis_url"], config["job_id"], trial=config.get("trial"))
    if config.get("out_dir"):
        return JsonlSink(Path(config["out_dir"]) / "metrics.jsonl")
    return NullSink()


def flush_reports() -> None:
    """Return once Ray Train's controller has taken every report this worker made.

    Ray Train's worker answers a poll by taking a report off its queue and *then* asking whether the training
    thread still runs (``RayTrainWorker.poll_status``): a last report put between the two, by a thread that
    then ends, is never taken, so the run's result (its metrics and checkpoint) is the epoch before the last
    (found reading Ray 2.60's code; tests/workers/on_ray/test_ray_train.py shows the report still queued when the
    function returns without this). The queue counts what was taken (``task_done`` after each
    ``get_nowait``), so waiting on it keeps the thread alive until then."""
    from ray.train.v2._internal.execution.context import get_train_context

    get_train_context().get_result_queue().join()


def train_worker(config: dict[str, Any]) -> None:
    """What every Ray Train worker runs: build the context, then the one training loop, and the last report
    handed over before it returns (``flush_reports``)."""
    try:
        _logged(config)
    finally:
        flush_reports()


def _logged(config: dict[str, Any]) -> None:
    import ray.train

    if config.get("pid_dir"):  # lets tests (and operators) find a worker process to kill
        rank = ray.train.get_context().get_world_rank()
        Path(config["pid_dir"], f"rank{rank}.pid").write_text(str(os.getpid()))
    if config.get("log_storage"):  # a service job's worker: its log is kept in storage (workers.job.logs)
        from workers.job.logs import capture
        from workers.job.record import attempt_of

        rank = ray.train.get_context().get_world_rank()
        name, attempt = f"rank-{rank}", attempt_of(config["redis_url"], config["job_id"])
        with capture(config["log_storage"], config["job_id"], name, attempt):
            return _train(config)
    return _train(config)


def _train(config: dict[str, Any]) -> None:
    import ray.train

    from workers.on_ray.ray_context import RayTrainContext
    from workers.train.gpu_share import fence_memory
    from workers.train.loop import train
    from workers.train.shared import TrainingDiverged

    spec = ExperimentSpec.model_validate(config["spec"])
    ctx = RayTrainContext(_worker_sink(config, ray.train.get_context().get_world_rank()),
                          resume_from=config.get("resume_from"), artifacts_dir=config.get("artifacts_dir"))
    fence_memory(spec.resources, ctx.device)  # before the model is built
    try:
        train(spec, ctx)
    except TrainingDiverged as err:
        # it would diverge again from its last checkpoint: end the run as failed instead of a retry
        ctx.save({"failed": str(err)}, {"failed": True, "reason": str(err)})
    finally:
        ctx.sink.close()


def build_trainer(
    spec: ExperimentSpec,
    *,
    name: str,
    storage_path: str | Path,
    redis_url: str | None = None,
    job_id: str | None = None,
    out_dir: str | Path | None = None,
    max_failures: int = 3,
    pid_dir: str | Path | None = None,
    trial: str | None = None,
    callbacks: list[Any] | None = None,
    resume_from: Any = None,
    artifacts: str | Path | None = None,
    keep_logs: bool = False,
) -> TorchTrainer:
    """One place turns a spec into a TorchTrainer (scaling, storage, failures, checkpoints).
    ``trial`` tags the events of a sweep's trial in the sweep's stream; ``callbacks`` go to RunConfig;
    ``resume_from``: a checkpoint to start from (Ray Train V2 takes it through the loop's config);
    ``artifacts``: the directory the loop sees as ``ctx.artifacts_dir``; ``keep_logs``: each rank's output is
    kept under the storage path (``workers.job.logs``; a service job's, not a trial's). Checkpoints kept: the last
    ``TLAB_KEEP_CHECKPOINTS`` (default 2)."""
    loop_config = {
        "spec": spec.model_dump(mode="json"),
        "redis_url": redis_url,
        "job_id": job_id or name,
        "trial": trial,
        "out_dir": None if out_dir is None else str(out_dir),
        "pid_dir": None if pid_dir is None else str(pid_dir),
        "resume_from": resume_from,
        "artifacts_dir": None if artifacts is None else str(artifacts),
        "log_storage": str(storage_path) if keep_logs else None,
    }
    return TorchTrainer(
        train_worker,
        train_loop_config=loop_config,
        scaling_config=scaling_config(spec),
        torch_config=torch_config(spec),
        run_config=RunConfig(
            name=name,
            storage_path=str(storage_path),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=keep_checkpoints()),
            callbacks=callbacks,
        ),
    )


def run_on_ray(spec: ExperimentSpec, out_dir: str | Path, *, address: str | None = None,
               code: str | Path | None = None) -> dict[str, Any]:
    """``tlab run SPEC --ray --out DIR [--code CODE]``: the spec as a TorchTrainer on a Ray cluster, same outputs as
    --local.

    ``address`` (or ``RAY_ADDRESS``) names an existing cluster; without one a local cluster is
    started for the run and stopped after it. Rank 0 writes DIR/metrics.jsonl, so DIR must be
    visible to the node it runs on (always true for a local cluster). ``code``: the user's package directory,
    sent to every worker as the runtime_env ``working_dir`` (Ray uploads it and puts it first on their path, as the
    service does with an uploaded package: ``service.launch.ray_cluster.RayJobs.runtime_env``); it needs the Ray
    connection this function makes.
    """
    import ray

    from plots.curves import plot_curves, read_metrics
    from workers.train.loop import run_label

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "summary.json", "curves.png"):
        (out / name).unlink(missing_ok=True)
    started = not ray.is_initialized()
    if code is not None and not started:
        raise RuntimeError("run_on_ray(code=...): Ray is already initialized in this process, so the code directory "
                           "cannot become its runtime_env working_dir; call it before ray.init")
    if started:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or None, log_to_driver=False,
                 include_dashboard=False, runtime_env={"working_dir": str(code)} if code is not None else None)
    try:
        result = build_trainer(spec, name=f"run-{out.name}", storage_path=out / "ray", out_dir=out).fit()
    finally:
        if started:
            ray.shutdown()
    summary = dict(result.metrics or {})
    records = read_metrics(out / "metrics.jsonl")
    if any(r.get("kind") == "epoch" for r in records):
        plot_curves({run_label(spec): records}, out / "curves.png",
                    title=f"{spec.dataset.name} · {spec.model.kind} · Ray × {spec.resources.workers}")
    if summary.get("failed"):
        raise RuntimeError(str(summary.get("reason")))
    summary = {**summary, "out_dir": str(out), "spec": spec.model_dump(mode="json")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return summary
