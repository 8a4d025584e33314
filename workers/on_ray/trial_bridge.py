"""A 1-worker sweep trial's training in the job's sandbox (issue 26), with Tune on the trusted side of the line.

The Tune trial's process (``workers.sweep``'s ``own_trial``) is the supervisor: it holds Ray and Tune's session, and
starts the trial's payload (``workers.payload``, kind ``trial``) in the sandbox. The payload trains with a
``BridgedTrialContext``: each epoch's checkpoint is written in the trial's scratch directory (the payload's only
writable place) and announced, with its metrics, as one JSON line on a pipe; the supervisor hands it to ``tune.report``
(Tune copies it into the trial's directory, ASHA and PBT decide) and answers on another pipe, so the loop waits for each
report as it did in-process (``workers.on_ray.trial.TrialContext``). A restored trial (a Tune retry, a PBT exploit)
starts from Tune's checkpoint, mounted read-only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any, BinaryIO

from api_schemas import ExperimentSpec
from workers.job.orders import Orders, Stopped
from workers.train.context import RunContext, read_checkpoint, write_checkpoint
from workers.train.failure import JobFailed


class BridgedTrialContext(RunContext):
    """One rank in a trial's payload: checkpoints and metrics go to Tune through its supervisor."""

    def __init__(self, *, reports: BinaryIO, answers: BinaryIO, scratch: Path, restore_from: Path | None,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.reports, self.answers, self.scratch, self.restore_from = reports, answers, scratch, restore_from

    def _tell(self, metrics: dict[str, Any], checkpoint: str | None = None) -> None:
        self.reports.write((json.dumps({"metrics": metrics, "checkpoint": checkpoint}, default=float) + "\n").encode())
        self.reports.flush()
        if not self.answers.readline():  # the supervisor reported it (Tune may end the trial meanwhile)
            # Tune ended the trial (ASHA stopped it; the trials table says so): this try ends as a stop, no traceback
            raise Stopped("the trial's supervisor is gone: the sweep's scheduler ended the trial")

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        tmp = Path(tempfile.mkdtemp(prefix="report-", dir=self.scratch))
        write_checkpoint(state, tmp)
        self._tell(metrics, str(tmp))  # Tune has copied it once answered; the supervisor removes it

    def report_metrics(self, metrics: dict[str, Any]) -> None:
        self._tell(metrics)

    def restore(self) -> dict[str, Any] | None:
        return read_checkpoint(self.restore_from) if self.restore_from else None


def train_bridged(orders: Orders, report_fd: int, answer_fd: int) -> dict[str, Any]:
    """The payload's side: ``workers.on_ray.trial.train_in_trial`` with a ``BridgedTrialContext``."""
    from workers.job.redis_sink import RedisSink
    from workers.on_ray.trial import train_in_trial
    from workers.train.gpu_share import claim_device

    spec = ExperimentSpec.model_validate_json(orders.spec)
    sink = RedisSink(orders.redis_url, orders.job_id, trial=orders.trial)
    with os.fdopen(report_fd, "wb") as reports, os.fdopen(answer_fd, "rb") as answers:
        train_in_trial(spec, sink, BridgedTrialContext(
            reports=reports, answers=answers, scratch=Path(orders.scratch), sink=sink, device=claim_device(spec),
            restore_from=Path(orders.start_from) if orders.start_from else None))
    return {}


def relay(line: bytes) -> None:
    """The supervisor's side of one report: to Tune, then the payload's copy removed."""
    from ray import tune

    report = json.loads(line)
    if report["checkpoint"] is None:
        tune.report(report["metrics"])
        return
    tune.report(report["metrics"], checkpoint=tune.Checkpoint.from_directory(report["checkpoint"]))
    shutil.rmtree(report["checkpoint"], ignore_errors=True)


def supervise_trial(spec: ExperimentSpec, job_id: str, trial_id: str, redis_url: str, storage: str) -> None:
    """A Tune trial's process: its training as a payload in the sandbox, its reports relayed to Tune."""
    from ray import tune

    from workers.on_ray.supervisor import payload_argv, run_payload

    scratch = Path(storage) / job_id / "trials" / trial_id  # (the sweep's own directory: its logs are there too)
    shutil.rmtree(scratch, ignore_errors=True)  # what a killed try left
    checkpoint = tune.get_checkpoint()
    with checkpoint.as_directory() if checkpoint else nullcontext() as restore:
        argv, env = payload_argv(spec, scratch, str(restore) if restore else None)
        orders = Orders(spec.model_dump_json(), job_id, redis_url, storage, -1, kind="trial", trial=trial_id,
                        scratch=str(scratch), start_from=str(restore) if restore else None)
        done = run_payload(orders, argv, env, relay=relay)
    shutil.rmtree(scratch, ignore_errors=True)
    if done.summary is None:
        raise JobFailed(done.error)
