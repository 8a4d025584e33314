"""A job's tries in its Ray job's driver, in this process: one rank (``workers.on_ray.driver``) or a gang it
leads (``workers.on_ray.gang``), retried from the last checkpoint. The sandboxed path is
``workers.on_ray.supervisor``, which starts ``workers.payload`` for each try; tests and benchmarks run this one."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from api_schemas import ExperimentSpec
from workers.job.redis_sink import RedisSink
from workers.on_ray.driver import DriverContext, attempt, close_quietly, retried
from workers.on_ray.gang import lead
from workers.train.failure import failure_reason
from workers.train.gpu_share import claim_device


def run_in_driver(spec: ExperimentSpec, job_id: str, redis_url: str, storage: str | Path, max_failures: int,
                  artifacts: str | Path | None = None, stopped: tuple[type[BaseException], ...] = (),
                  start_from: Path | None = None, placement: Sequence[str] = (), ranks: Any = None) -> dict[str, Any]:
    """Train ``spec`` in this process, reporting to the job's Redis stream; retry from the last checkpoint up
    to ``max_failures`` times. Returns the summary (``attempt``). ``stopped``: what a stop raises
    (a stop exception, e.g. ``workers.job.harness.Stopped``): never retried. ``start_from``: the
    checkpoint to start from while the run has none of its own (``start_checkpoint``). With several workers
    this process is rank 0 of a gang it leads (``workers.on_ray.gang``; ``placement``: the scheduler's node per rank;
    ``ranks``: the first try's other ranks, if started already: ``workers.on_ray.gang_start.Ranks``)."""
    device = claim_device(spec)  # (its share of the card fenced before any model is built)
    failures = 0
    while True:
        sink = RedisSink(redis_url, job_id)
        try:
            if spec.resources.workers > 1:
                first, ranks = ranks, None  # a retry starts its own
                summary = lead(spec, job_id, redis_url, storage, sink, device, artifacts, start_from, placement,
                               first)
            else:
                summary = attempt(spec, DriverContext(sink, Path(storage) / job_id, device=device,
                                                      artifacts_dir=artifacts, start_from=start_from))
        except BaseException as err:
            failures += 1
            if not retried(err, stopped) or failures > max_failures:
                close_quietly(sink)
                raise
            traceback.print_exc()  # the whole story, for the job's log
            note = (f"retry {failures} of TLAB_MAX_FAILURES={max_failures} from the last checkpoint after: "
                    f"{failure_reason(err)}")
            print(note, file=sys.stderr, flush=True)
            close_quietly(sink, {"kind": "log", "level": "warning", "message": note})
            continue
        sink.close()
        return summary
