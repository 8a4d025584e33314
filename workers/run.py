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

import argparse
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import redis

from api_schemas import ExperimentSpec, keys
from api_schemas.reasons import FAILURE_MARK, one_line
from workers.job.artifacts import artifacts_dir
from workers.job.bucket import pull_checkpoint, push
from workers.job.logs import also_as, capture
from workers.job.record import attempt_of, job_field, write_summary
from workers.job.redis_sink import RedisSink
from workers.job.ticket import TicketError, job_redis_url
from workers.job.vitals import watch as watch_vitals
from workers.train.failure import JobFailed, failure_reason
from workers.train.startup import begin, mark, timeline


class SetupError(RuntimeError):
    """The job cannot start: the message says what to set."""


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise SetupError(f"{name} is not set: the scheduler passes it in the Ray job's runtime_env "
                         f"(env_vars); set it by hand to run `python -m workers.run` yourself")
    return value


def load_job_spec(client: redis.Redis, job_id: str) -> ExperimentSpec:
    raw = job_field(client, job_id, "spec")
    if raw is None:
        raise SetupError(f"job {job_id} has no spec in Redis (key {keys.job(job_id)}): was it submitted?")
    return ExperimentSpec.model_validate_json(raw)


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
    if in_driver() and spec.resources.workers > 1:  # the gang's other ranks start while this driver imports
        from workers.on_ray.gang_start import Ranks

        ranks = Ranks(spec, job_id, redis_url, storage, placement(), out)
        mark("ranks")
    try:
        from workers.job.start_from import start_checkpoint

        pull_checkpoint(storage, job_id)  # the bucket's newest, when newer than any here (``workers.job.bucket``)
        start = start_checkpoint(client, job_id, storage)  # a continued or forked job's parent checkpoint
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
        if not in_driver():
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


def export_artifacts(spec: ExperimentSpec, run_dirs: list[Path], out: Path, extra: dict | None = None) -> None:
    """``workers.job.artifacts.export``; a failure to export is logged, never the job's own failure."""
    from workers.job.artifacts import export

    try:
        names = export(spec, run_dirs, out, extra)
        print(f"artifacts: {', '.join(names) or 'none (no checkpoint yet)'} in {out}", file=sys.stderr, flush=True)
    except Exception:
        traceback.print_exc()
        print(f"artifacts: could not export them to {out} (see above)", file=sys.stderr, flush=True)


class Stopped(Exception):
    """SIGTERM: Ray stopped the job (a cancel, a time limit, a preemption); SIGKILL follows after the grace."""


def raise_stopped(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Stopped("stopped by the scheduler (cancel, time limit or preemption)")


def report_failure(sink: RedisSink, reason: str) -> None:
    """The one-line reason, as a marked line of the job's log (first: it needs no Redis) and as the job's
    last error event."""
    print(f"{FAILURE_MARK}{reason}", file=sys.stderr, flush=True)
    sink.emit({"kind": "log", "level": "error", "message": reason})


def job_main(prog: str, description: str, run: Callable[[str, str, str], dict], argv: list[str] | None) -> int:
    """What a Ray job's entrypoint does around ``run(job_id, redis_url, storage)``: status events, and
    every failure turned into one line the user can read (``report_failure``)."""
    begin()  # the start-up timeline (``workers.train.startup``), sent with ``finished``
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--job", required=True, help="the job id (its spec is in Redis)")
    args = parser.parse_args(argv)
    try:
        redis_url = job_redis_url()  # the one-time ticket redeemed: from here on an argument, never in an env
        if not redis_url:
            _env("REDIS_URL")
        storage = _env("TLAB_STORAGE")
    except (SetupError, TicketError) as err:
        print(f"{FAILURE_MARK}{err}", file=sys.stderr)  # no Redis to say it in: the scheduler reads it from Ray
        return 2
    with capture(storage, args.job, "driver", attempt_of(redis_url, args.job)):
        return guarded(args.job, redis_url, storage, run)


def guarded(job_id: str, redis_url: str, storage: str, run: Callable[[str, str, str], dict]) -> int:
    """``run`` with its status events and its exit status, every failure a one-line reason."""
    sink = RedisSink(redis_url, job_id)
    sink.emit({"kind": "status", "state": "running", "pid": os.getpid()})
    signal.signal(signal.SIGTERM, raise_stopped)  # unwinds through run()'s finally: the artifacts are exported
    vitals = watch_vitals(redis_url, job_id)  # what a SIGKILL leaves the scheduler to go by (service.scheduler.deaths)
    try:
        summary = run(job_id, redis_url, storage)
    except Stopped as err:
        sink.emit({"kind": "log", "level": "info", "message": str(err)})
        return 143
    except SetupError as err:
        report_failure(sink, one_line(str(err)))
        return 2
    except Exception as err:  # the job boundary: every failure becomes a reason the user can read
        traceback.print_exc()  # the whole story, for the job's log
        report_failure(sink, failure_reason(err))
        return 1
    finally:
        vitals.set()
        sink.flush()
    sink.emit({"kind": "status", "state": "finished", "summary": summary, "startup": timeline()})
    sink.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m workers.run", __doc__.splitlines()[0], run_job, argv)


def exit_now(code: int) -> None:
    """End the Ray job's driver with ``code`` once its work and its log are done, without the interpreter's
    teardown: a 2-worker gang's driver (Ray's core worker and torch.distributed's store both alive) died in
    native code at exit now and then (one job of three in a benchmark), after reporting `finished`, and Ray then
    called the job FAILED with a libc frame as its reason."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
