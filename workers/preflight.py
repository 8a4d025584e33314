"""``python -m workers.preflight --job ID``: try a job's code on one CPU before its gang is held.

The scheduler submits it as a small Ray job (1 CPU, no GPU, in the job's runtime_env: its package as
``working_dir``, its requirements as ``pip``; as the job's own Redis user) for every job that runs the user's
code, and the API for ``POST /v1/experiments?dry_run=true`` (``service.scheduler.preflight``). It imports the factories
(an own loop: the entrypoint, whose signature alone is checked), builds model and data, runs one forward and
backward on a small batch and one teleport step on a teleport batch, and writes its verdict
(``api_schemas.preflight.PreflightResult``) to ``keys.preflight(job)``: parameter count, dataset sizes and sample
shape, the layers with their free directions at the spec's tau, the parameters teleport leaves as they are and
why; or the one line (``mylab/models.py:88: NameError: ...``) whose full traceback goes to the job's log
(``attempt-1/preflight.log``). It exits 0 whenever it wrote a verdict, passed or failed.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="the job id (its spec is in Redis)")
    args = parser.parse_args(argv)
    from api_schemas.reasons import FAILURE_MARK
    from workers.job.ticket import TicketError, job_redis_url

    try:
        redis_url, storage = job_redis_url(), os.environ.get("TLAB_STORAGE")  # the ticket redeemed, if one
    except TicketError as err:
        print(f"{FAILURE_MARK}{err}", file=sys.stderr)  # the scheduler reads it from Ray: no_verdict
        return 2
    if not redis_url or not storage:
        print("error: TLAB_JOB_TICKET (or REDIS_URL) and TLAB_STORAGE must be set (the scheduler passes them in the "
              "runtime_env)", file=sys.stderr)
        return 2
    from workers.on_ray.supervisor import supervise_preflight

    return supervise_preflight(args.job, redis_url, storage)  # ``run_preflight`` in the job's sandbox


if __name__ == "__main__":
    sys.exit(main())
