"""``python -m workers.run --job ID``: what the scheduler submits as a Ray job for one experiment.

Reads the job's spec from Redis, runs it as a Ray Train TorchTrainer on the cluster this Ray job
lives in (a 1-worker job trains right here in the driver instead: ``workers.on_ray.driver``), streams events
to the job's Redis stream (rank 0), and on success stores the summary in the job hash.
Exit status: 0 succeeded, 1 failed, 2 bad setup (missing environment, unknown job).
A failure's reason is one line (``workers.train.failure``): the last error ``log`` event, and a line of
the job's log after ``TLAB-FAILURE:``; the traceback goes to the job's log above it.

However it ends (a SIGTERM from a cancel or a time limit too), the driver writes the job's artifacts to
``$TLAB_STORAGE/<job>/artifacts/`` from its last checkpoint (``workers.job.artifacts``).

Environment: ``TLAB_JOB_TICKET`` (the scheduler's one-time ticket to the job's own Redis user:
``workers.job.ticket``) or ``REDIS_URL`` (run by hand), ``TLAB_STORAGE`` (Ray Train storage path for
checkpoints, shared by all nodes), ``TLAB_MAX_FAILURES`` (worker restarts, default 3),
``TLAB_KEEP_CHECKPOINTS`` (checkpoints kept per run, default 2), ``TLAB_IN_DRIVER`` (``0``: a 1-worker job
runs as a TorchTrainer too; the scheduler sets it with the resources it asks Ray for: ``RayJobs.submit``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import redis

from api_schemas import ExperimentSpec
from workers.job.artifacts import artifacts_dir
from workers.job.bucket import pull_checkpoint, push
from workers.job.fence import still_current
from workers.job.harness import exit_now, export_artifacts, job_main, load_job_spec
from workers.job.logs import also_as
from workers.job.record import write_summary
from workers.train.failure import JobFailed
from workers.train.startup import mark


def in_driver() -> bool:
    """The job trains in this driver (``workers.on_ray.driver``; several workers: as rank 0 of a gang it leads,
    ``workers.on_ray.gang``), unless ``TLAB_IN_DRIVER=0`` (the scheduler sets it per Ray job, with the resources it
    asks Ray for): then as a Ray Train TorchTrainer."""
    return os.environ.get("TLAB_IN_DRIVER", "1") != "0"


def placement() -> list[str]:
    """The scheduler's node per worker (``TLAB_PLACEMENT``, a JSON list; empty when not given)."""
    return list(json.loads(os.environ.get("TLAB_PLACEMENT") or "[]"))


def run_job(job_id: str, redis_url: str, storage: str, max_failures: int | None = None) -> dict:
    """Train the job's spec (in this driver, or as a TorchTrainer on the current Ray cluster); return the
    summary (raises on failure). ``max_failures`` (retries) defaults to ``TLAB_MAX_FAILURES``, else 3."""
    if max_failures is None:
        max_failures = int(os.environ.get("TLAB_MAX_FAILURES", "3"))
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    spec = load_job_spec(client, job_id)
    out = artifacts_dir(storage, job_id)
    ranks = None
    try:
        from workers.job.start_from import start_checkpoint

        pull_checkpoint(storage, job_id)  # the bucket's newest, when newer than any here (``workers.job.bucket``)
        # a continued or forked job's parent checkpoint, decided once, here: a gang's ranks get it as an argument
        start = start_checkpoint(client, job_id, storage)
        if in_driver() and spec.resources.workers > 1:  # the gang's other ranks start while this driver imports
            from workers.on_ray.gang_start import Ranks

            ranks = Ranks(spec, job_id, redis_url, storage, placement(), out, start)
            mark("ranks")
        if in_driver():  # its payload trains, in a sandbox (``workers.on_ray.supervisor``), and exports the artifacts
            from workers.on_ray.supervisor import supervise

            also_as("rank-0")  # the payload's output comes through this process: its log is rank 0's
            summary = supervise(spec, job_id, redis_url, storage, max_failures, out, start, placement(), ranks)
        else:
            from workers.on_ray.supervisor import refuse_unsandboxed

            refuse_unsandboxed(spec)  # Ray Train's workers run the user's code outside any sandbox
            mark("torch")  # (the trainer's modules come next: the start-up timeline's phase, ``workers.train.startup``)
            summary = fit_trainer(spec, job_id, redis_url, storage, max_failures, out, start)
    finally:  # however it ended (a stop too: SIGTERM leaves the grace period for this), from the last checkpoint
        if ranks is not None:
            ranks.stop()  # (a no-op once the first try has ended them)
        if not in_driver() and still_current(job_id, "artifacts not exported"):  # (``workers.job.fence``)
            export_artifacts(spec, [Path(storage) / job_id], out)
        push(storage, job_id, prune=True, final=True)  # the run's last word (its checkpoint uploads may be cut off)
    if summary.get("failed"):
        raise JobFailed(str(summary.get("reason", "training failed")))
    write_summary(client, job_id, json.dumps(summary))
    return summary


def fit_trainer(spec: ExperimentSpec, job_id: str, redis_url: str, storage: str, max_failures: int,
                out: Path, start: Path | None = None) -> dict:
    """The spec as a Ray Train TorchTrainer; its ``result.metrics``. It starts from the run's newest checkpoint
    when Ray Train has none of its own (an earlier attempt trained in the driver), else from ``start`` (a
    continued or forked job's parent checkpoint) if given."""
    import ray
    from ray.train import Checkpoint

    from workers.job.artifacts import checkpoints
    from workers.on_ray.ray_train import build_trainer

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
    found = checkpoints([Path(storage) / job_id])
    trainer = build_trainer(spec, name=job_id, storage_path=storage, redis_url=redis_url, job_id=job_id,
                            max_failures=max_failures, artifacts=out, keep_logs=True,
                            resume_from=Checkpoint.from_directory(str(found[0] if found else start))
                            if found or start else None)
    return dict(trainer.fit().metrics or {})














def main(argv: list[str] | None = None) -> int:
    return job_main("python -m workers.run", __doc__.splitlines()[0], run_job, argv)




if __name__ == "__main__":
    exit_now(main())
