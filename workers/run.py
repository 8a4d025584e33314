"""``python -m workers.run --job ID``: what the scheduler submits as a Ray job for one experiment.

Reads the job's spec from Redis, runs it as a Ray Train TorchTrainer on the cluster this Ray job
lives in, streams events to the job's Redis stream (rank 0), and on success stores the summary in
the job hash. Exit status: 0 succeeded, 1 failed (the reason is the last ``log`` event), 2 bad
setup (missing environment, unknown job).

Environment: ``REDIS_URL`` (the service's Redis), ``TLAB_STORAGE`` (Ray Train storage path for
checkpoints, shared by all nodes), ``TLAB_MAX_FAILURES`` (worker restarts, default 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import redis

from api_schemas import ExperimentSpec, keys
from workers.redis_sink import RedisSink


class SetupError(RuntimeError):
    """The job cannot start: the message says what to set."""


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise SetupError(f"{name} is not set: the scheduler passes it in the Ray job's runtime_env "
                         f"(env_vars); set it by hand to run `python -m workers.run` yourself")
    return value


def load_job_spec(client: redis.Redis, job_id: str) -> ExperimentSpec:
    raw = client.hget(keys.job(job_id), "spec")
    if raw is None:
        raise SetupError(f"job {job_id} has no spec in Redis (key {keys.job(job_id)}): was it submitted?")
    return ExperimentSpec.model_validate_json(raw)


def run_job(job_id: str, redis_url: str, storage: str, max_failures: int = 3) -> dict:
    """Train the job's spec on the current Ray cluster; return the summary (raises on failure)."""
    import ray

    from workers.ray_train import build_trainer

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    spec = load_job_spec(client, job_id)
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
    trainer = build_trainer(spec, name=job_id, storage_path=storage, redis_url=redis_url, job_id=job_id,
                            max_failures=max_failures)
    result = trainer.fit()
    summary = dict(result.metrics or {})
    if summary.get("failed"):
        raise RuntimeError(str(summary.get("reason", "training failed")))
    client.hset(keys.job(job_id), "summary", json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.run", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="the job id (its spec is in Redis)")
    args = parser.parse_args(argv)
    try:
        redis_url, storage = _env("REDIS_URL"), _env("TLAB_STORAGE")
    except SetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sink = RedisSink(redis_url, args.job)
    sink.emit({"kind": "status", "state": "running", "pid": os.getpid()})
    try:
        summary = run_job(args.job, redis_url, storage, int(os.environ.get("TLAB_MAX_FAILURES", "3")))
    except SetupError as err:
        sink.emit({"kind": "log", "level": "error", "message": str(err)})
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the job boundary: every failure becomes a reason the user can read
        sink.emit({"kind": "log", "level": "error", "message": f"{type(err).__name__}: {err}",
                   "traceback": traceback.format_exc(limit=20)})
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        sink.flush()
    sink.emit({"kind": "status", "state": "finished", "summary": summary})
    sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
