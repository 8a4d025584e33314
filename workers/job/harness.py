"""What every Ray job's entrypoint does around its work (``workers.run``, ``workers.sweep``): the job's spec read,
its status events, a stop turned into an exception, the artifacts exported, and every failure one line the user
can read (``workers.train.failure``), marked in the job's log for the scheduler."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import redis

from api_schemas import ExperimentSpec, keys
from api_schemas.reasons import ENDED_EXIT, FAILURE_MARK, one_line
from workers.job.fence import AttemptEnded, pin
from workers.job.logs import capture
from workers.job.record import attempt_of, job_field
from workers.job.redis_sink import RedisSink
from workers.job.ticket import TicketError, job_redis_url
from workers.job.vitals import watch as watch_vitals
from workers.train.failure import failure_reason
from workers.train.startup import begin, timeline


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


def export_artifacts(spec: ExperimentSpec, run_dirs: list[Path], out: Path, extra: dict | None = None,
                     attempt: int | None = None) -> None:
    """``workers.job.artifacts.export``; a failure to export is logged, never the job's own failure."""
    from workers.job.artifacts import export

    try:
        names = export(spec, run_dirs, out, extra, attempt)
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
    attempt = attempt_of(redis_url, args.job)
    pin(args.job, attempt, redis_url)  # every write of this process carries it (``workers.job.fence``)
    with capture(storage, args.job, "driver", attempt):
        return guarded(args.job, redis_url, storage, run)


def guarded(job_id: str, redis_url: str, storage: str, run: Callable[[str, str, str], dict]) -> int:
    """``run`` with its status events and its exit status, every failure a one-line reason."""
    sink = RedisSink(redis_url, job_id)
    sink.emit({"kind": "status", "state": "running", "pid": os.getpid()})
    signal.signal(signal.SIGTERM, raise_stopped)  # unwinds through run()'s finally: the artifacts are exported
    vitals = watch_vitals(redis_url, job_id)  # what a SIGKILL leaves the scheduler to go by (service.scheduler.deaths)
    try:
        summary = run(job_id, redis_url, storage)
    except AttemptEnded as err:  # the service moved on: this attempt writes nothing more, anywhere
        print(f"[tlab] {err}; this process ends", file=sys.stderr, flush=True)
        sink.buffer.clear()
        return ENDED_EXIT
    except Stopped as err:
        with contextlib.suppress(AttemptEnded):
            sink.emit({"kind": "log", "level": "info", "message": str(err)})
        return 143
    except SetupError as err:
        with contextlib.suppress(AttemptEnded):
            report_failure(sink, one_line(str(err)))
        return 2
    except Exception as err:  # the job boundary: every failure becomes a reason the user can read
        traceback.print_exc()  # the whole story, for the job's log
        with contextlib.suppress(AttemptEnded):  # (an ended attempt's reason lands nowhere: its log has it)
            report_failure(sink, failure_reason(err))
        return 1
    finally:
        vitals.set()
        with contextlib.suppress(AttemptEnded):
            sink.flush()
    try:
        sink.emit({"kind": "status", "state": "finished", "summary": summary, "startup": timeline()})
        sink.close()
    except AttemptEnded as err:
        print(f"[tlab] {err}; this process ends", file=sys.stderr, flush=True)
        return ENDED_EXIT
    return 0


def exit_now(code: int) -> None:
    """End the Ray job's driver with ``code`` once its work and its log are done, without the interpreter's
    teardown: a 2-worker gang's driver (Ray's core worker and torch.distributed's store both alive) died in
    native code at exit now and then (one job of three in a benchmark), after reporting `finished`, and Ray then
    called the job FAILED with a libc frame as its reason."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
