"""A 1-worker sweep trial's training in the job's sandbox, with Tune on the trusted side of the line.

The Tune trial's process (``workers.sweep``'s ``own_trial``) is the supervisor: it holds Ray and Tune's session, and
starts the trial's payload (``workers.payload``, kind ``trial``) in the sandbox. The payload trains with a
``BridgedTrialContext``: each epoch's checkpoint is written in the trial's scratch directory (the payload's only
writable place) and announced, with its metrics, as one JSON line on a pipe; the supervisor hands it to ``tune.report``
(Tune copies it into the trial's directory, ASHA and PBT decide) and answers on another pipe, so the loop waits for each
report as it did in-process (``workers.on_ray.trial.TrialContext``). A restored trial (a Tune retry, a PBT exploit)
starts from Tune's checkpoint, mounted read-only.

A report is the payload's word, so the supervisor (``Relay``) takes it through ``api_schemas.gate``: the checkpoint
must be a directory directly in the trial's scratch (which the supervisor made), reached without a link; it is copied
as regular files only (no link followed, bounded by ``TLAB_MAX_JOB_GB`` and ``TLAB_MAX_JOB_FILES``) into a directory of
the supervisor's own, and that copy is what Tune gets. A report naming anything else fails the trial.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any, BinaryIO

from api_schemas import ExperimentSpec, gate
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
        self._tell(metrics, str(tmp))  # the supervisor has copied it once answered, and removed it

    def report_metrics(self, metrics: dict[str, Any]) -> None:
        self._tell(metrics)

    def restore(self) -> dict[str, Any] | None:
        return read_checkpoint(self.restore_from) if self.restore_from else None


def train_bridged(orders: Orders, report_fd: int, answer_fd: int) -> dict[str, Any]:
    """The payload's side: ``workers.on_ray.trial.train_in_trial`` with a ``BridgedTrialContext``."""
    from workers.job.pipe_sink import records_sink
    from workers.on_ray.trial import train_in_trial
    from workers.train.gpu_share import claim_device

    spec = ExperimentSpec.model_validate_json(orders.spec)
    sink = records_sink(orders)  # (its supervisor tags it)
    with os.fdopen(report_fd, "wb") as reports, os.fdopen(answer_fd, "rb") as answers:
        train_in_trial(spec, sink, BridgedTrialContext(
            reports=reports, answers=answers, scratch=Path(orders.scratch), sink=sink, device=claim_device(spec),
            restore_from=Path(orders.start_from) if orders.start_from else None))
    return {}


def copy_bounds() -> tuple[int, int]:
    """Bytes and files one reported checkpoint may hold: a job directory's limits (``TLAB_MAX_JOB_GB``,
    ``TLAB_MAX_JOB_FILES``; 100 GB and 100,000 by default, as the scheduler's)."""
    gb = float(os.environ.get("TLAB_MAX_JOB_GB") or 100)
    return int(gb * 2**30), int(os.environ.get("TLAB_MAX_JOB_FILES") or 100_000)


class Relay:
    """The supervisor's side of a trial's reports: each one's metrics (and checkpoint, taken through the gate) to
    Tune. ``storage``/``job_id``/``trial_id``: where the trial's scratch is, which the supervisor made."""

    def __init__(self, storage: str, job_id: str, trial_id: str) -> None:
        self.storage, self.scratch = storage, (job_id, "trials", gate.trial_id(trial_id))

    def __call__(self, line: bytes) -> None:
        from ray import tune

        report = json.loads(line)
        metrics = report.get("metrics") if isinstance(report, dict) else None
        if not isinstance(metrics, dict):
            raise gate.Refused("a trial's report refused: no metrics")
        if report.get("checkpoint") is None:
            tune.report(metrics)
            return
        name = self.report_dir(report["checkpoint"])
        max_bytes, max_files = copy_bounds()
        with tempfile.TemporaryDirectory(prefix="tlab-report-") as own:  # the supervisor's, outside storage
            copied = gate.copy_tree(self.storage, (*self.scratch, name), own, max_bytes, max_files)
            if copied.left_out:
                print(f"the trial's checkpoint {name}: left out (links or special files, not copied): "
                      f"{', '.join(copied.left_out[:10])}", file=sys.stderr, flush=True)
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(own))  # Tune copies it before returning
        gate.remove_tree(self.storage, *self.scratch, name)  # the payload's directory, reached without a link

    def report_dir(self, named: object) -> str:
        """The name of the directory a report names, if it lies directly in the trial's scratch; else ``Refused``."""
        scratch = os.path.join(self.storage, *self.scratch)
        parts = gate.named_under(scratch, named) if isinstance(named, str) else ()
        if len(parts) != 1:
            raise gate.Refused(f"a trial's checkpoint {str(named)[:200]!r} refused: a report names a directory "
                               f"in the trial's own {scratch}")
        return parts[0]


def supervise_trial(spec: ExperimentSpec, job_id: str, trial_id: str, redis_url: str, storage: str) -> None:
    """A Tune trial's process: its training as a payload in the sandbox, its reports relayed to Tune."""
    from ray import tune

    from workers.on_ray.supervisor import payload_argv, run_payload

    relay = Relay(storage, job_id, trial_id)
    scratch = Path(storage, *relay.scratch)  # (the sweep's own directory: its logs are there too)
    gate.remove_tree(storage, *relay.scratch)  # what a killed try left (no link in it followed)
    checkpoint = tune.get_checkpoint()
    with checkpoint.as_directory() if checkpoint else nullcontext() as restore:
        argv, env = payload_argv(spec, scratch, str(restore) if restore else None)
        orders = Orders(spec.model_dump_json(), job_id, redis_url, storage, -1, kind="trial", trial=trial_id,
                        scratch=str(scratch), start_from=str(restore) if restore else None)
        done = run_payload(orders, argv, env, relay=relay)
    gate.remove_tree(storage, *relay.scratch)
    if done.summary is None:
        raise JobFailed(done.error)
