"""``python -m workers.payload``: one try of a job's training, in its sandbox (``workers.job.sandbox``).

Its supervisor (``workers.on_ray.supervisor``: the Ray job's driver, or a gang rank's Ray task) starts it and hands it
``Orders`` on stdin; it says it started, trains one try as ``workers.on_ray.driver`` / ``workers.on_ray.gang`` do
in-process, exports the run's artifacts (rank 0), and writes its ``Outcome`` (JSON) to the descriptor the orders name.
It holds no Ray connection, no ticket and no Redis login: rank 0's records go as JSON lines on a pipe to its
supervisor, which writes them to the job's stream (``workers.job.pipe_sink``); rank 0 of a gang opens the gang's TCP
store on the socket its supervisor opened (``listen_fd``, inherited), and waits for the other ranks there (its
supervisor watches their Ray tasks and ends this process if one fails first).

Exit status: 0 trained, 1 failed, 143 stopped (a SIGTERM: from Ray's stop, or forwarded by the supervisor).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from workers.job.orders import Orders, Outcome, Stopped, say_started
from workers.train.startup import begin, mark, timeline


def stop_once(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Ray's and the supervisor's may both arrive: one stop
    raise Stopped("stopped by the scheduler (cancel, time limit or preemption)")


def wait_for_ranks(store: Any, world: int) -> None:
    """Rank 0 waits until every other rank reached the store (their Ray tasks are its supervisor's to watch)."""
    from workers.on_ray.gang import timeout

    names = [f"joined/{k}" for k in range(1, world)]
    deadline = time.monotonic() + timeout().total_seconds()
    while not store.check(names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gang's other ranks did not start within TLAB_GANG_TIMEOUT_S="
                               f"{timeout().total_seconds():g} s (are their nodes' resources free?)")
        time.sleep(0.05)


def train(orders: Orders) -> dict[str, Any]:
    """One try: a single rank, rank 0 leading a gang, or another rank of it (``workers.on_ray.gang``)."""
    import torch.distributed as dist

    from api_schemas import ExperimentSpec
    from workers.job.pipe_sink import records_sink
    from workers.on_ray.driver import DriverContext, attempt
    from workers.on_ray.gang import GangContext, join, said, timeout
    from workers.train.gpu_share import claim_device

    mark("torch")
    spec = ExperimentSpec.model_validate_json(orders.spec)
    device, world = claim_device(spec), spec.resources.workers  # (its share of the card fenced first)
    run_dir, start = Path(orders.storage) / orders.job_id, Path(orders.start_from) if orders.start_from else None
    sink = records_sink(orders)  # (rank 0)
    fencing = {"attempt": orders.attempt, "fence": getattr(sink, "check", None)}  # (its supervisor checks: rank 0)
    try:
        if world == 1:
            return attempt(spec, DriverContext(sink, run_dir, device=device, artifacts_dir=orders.artifacts,
                                               start_from=start, **fencing))
        store = None
        if orders.rank == 0:
            store = dist.TCPStore(orders.host, orders.port, world, is_master=True, timeout=timeout(),
                                  wait_for_workers=False, master_listen_fd=orders.listen_fd)
            wait_for_ranks(store, world)
        backend = join(orders.host, orders.port, orders.rank, spec, device, store)
        if orders.rank == 0:
            mark("group")
            said(f"gang of {world} on {backend}: every rank joined")
        try:
            return attempt(spec, GangContext(sink, run_dir, rank=orders.rank, world_size=world, device=device,
                                             artifacts_dir=orders.artifacts, start_from=start, **fencing))
        finally:
            dist.destroy_process_group()
    finally:
        sink.close()


def export(orders: Orders) -> None:
    """Rank 0 writes the run's artifacts from its last checkpoint, here in the sandbox, however the try ended: with
    an attempt, from its own checkpoints into its staging directory, which its supervisor promotes
    (``workers.job.artifacts.promote``)."""
    if orders.rank != 0 or not orders.artifacts:
        return
    from api_schemas import ExperimentSpec
    from workers.job.artifacts import staging_dir
    from workers.job.harness import export_artifacts

    spec = ExperimentSpec.model_validate_json(orders.spec)
    out = Path(orders.artifacts) if orders.attempt is None else staging_dir(Path(orders.artifacts), orders.attempt)
    export_artifacts(spec, [Path(orders.storage) / orders.job_id], out, attempt=orders.attempt)


def outcome(orders: Orders) -> Outcome:
    from workers.on_ray.driver import retried
    from workers.train.failure import failure_reason

    try:
        if orders.kind == "trial":
            from workers.on_ray.trial_bridge import train_bridged

            return Outcome(summary=train_bridged(orders, orders.report_fd or -1, orders.answer_fd or -1))
        if orders.kind == "preflight":
            from workers.job.preflight_check import run_preflight

            return Outcome(summary={"preflight": run_preflight(orders).model_dump(mode="json")})
        try:
            summary = train(orders)
        finally:
            export(orders)
    except Stopped as err:
        return Outcome(error=str(err), stopped=True)
    except Exception as err:  # the try's boundary: its supervisor retries or fails the job with this line
        traceback.print_exc()  # the whole story, for the job's log
        return Outcome(error=failure_reason(err), retried=retried(err))
    return Outcome(summary=summary)


def main() -> int:
    signal.signal(signal.SIGTERM, stop_once)
    begin()
    orders = Orders(**json.loads(sys.stdin.read()))
    say_started(orders.result_fd)
    result = outcome(orders)
    result.startup = timeline()
    with os.fdopen(orders.result_fd, "w") as out:
        out.write(json.dumps(asdict(result), default=str))
    return 0 if result.summary is not None else 143 if result.stopped else 1


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # (a gang's process group and torch's threads: no interpreter teardown, as ``workers.run``)
