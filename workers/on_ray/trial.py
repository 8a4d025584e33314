"""A 1-worker sweep trial trains in the Tune trial itself: the same loop, no TorchTrainer per trial.

A single rank needs no process group, so ``train_in_trial`` runs ``workers.train.loop.train`` right in the trial's
process (``tune.with_resources`` gives the trial the worker's CPUs and GPUs: ``trial_resources``), as a 1-worker
experiment trains in its job's driver (``workers.on_ray.driver``). ``TrialContext`` does what Ray Train did for it:

- each epoch's checkpoint and summary go to Tune (``ray.tune.report``), the summary being what
  ``TuneReportCallback`` forwarded from the TorchTrainer before, so the trials table, ASHA and PBT read the
  same keys; Tune keeps the checkpoints in the trial's own directory (``trial_dirs``);
- ``restore`` reads ``ray.tune.get_checkpoint()``: the trial's last one after a Tune retry or a
  ``Tuner.restore``, or the top trial's after a PBT exploit (the spec's mutated hyperparameters win);
- events go to the sweep's stream tagged with the trial, deduplicated there (``RedisSink``), so an epoch
  redone after a restart is recorded once.

A PBT interval costs no start-up: the trial reports a checkpoint every epoch and PBT pauses, exploits and
restarts it from one, in one short-lived process per interval with no worker group to start.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from api_schemas import ExperimentSpec, gate
from api_schemas.spec import ray_memory
from api_schemas.sweeps import SweepSubmit
from workers.train.context import RunContext, read_checkpoint, write_checkpoint
from workers.train.sinks import MetricSink


def in_trial(sweep: SweepSubmit) -> bool:
    """Whether the sweep's trials train in the trial (1 worker, whatever the search space draws) unless
    ``TLAB_IN_DRIVER=0``, which sends 1-worker experiments and trials alike through a TorchTrainer."""
    drawn = any(path.startswith("resources.") for path in sweep.search_space)
    return sweep.base.resources.workers == 1 and not drawn and os.environ.get("TLAB_IN_DRIVER", "1") != "0"


def trial_resources(sweep: SweepSubmit) -> dict[str, float]:
    """What an in-trial trial holds in Ray: its one worker's CPUs, GPUs and memory (the gang the scheduler counts)."""
    r = sweep.base.resources
    held = {"cpu": r.cpus_per_worker, **({"gpu": r.gpus_per_worker} if r.gpus_per_worker > 0 else {})}
    if r.memory_gb:
        held["memory"] = ray_memory(r.memory_gb)
    return {**held, f"accelerator_type:{r.gpu_type}": 0.001} if r.gpu_type else held  # Ray's accelerator_type=


def trial_dirs(storage: str | Path, job_id: str, trial_id: str) -> list[Path]:
    """The directories Tune keeps a trial's reported checkpoints in (``<storage>/sweep-<job>/<...trial id...>``):
    the trial's id checked by the gate, each a real directory (no link) of the sweep's own."""
    trial, sweep = gate.trial_id(trial_id), f"sweep-{job_id}"
    try:
        fd = gate.open_dir(storage, sweep)
    except (OSError, gate.Refused):
        return []
    try:
        with os.scandir(fd) as entries:
            names = sorted(e.name for e in entries if trial in e.name and e.is_dir(follow_symlinks=False))
    finally:
        os.close(fd)
    return [Path(storage, sweep, name) for name in names]


class TrialContext(RunContext):
    """One rank in a Tune trial's process: checkpoints and metrics reported to Tune every epoch."""

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        from ray import tune

        with tempfile.TemporaryDirectory() as tmp:  # Tune copies it into the trial's directory before returning
            write_checkpoint(state, Path(tmp))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))

    def report_metrics(self, metrics: dict[str, Any]) -> None:
        from ray import tune

        tune.report(metrics)

    def restore(self) -> dict[str, Any] | None:
        from ray import tune

        checkpoint = tune.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as path:
            return read_checkpoint(Path(path))


def train_in_trial(spec: ExperimentSpec, sink: MetricSink, ctx: RunContext | None = None) -> None:
    """Train ``spec`` in this Tune trial; a diverged run reports its failure as ``train_worker`` does (its row
    shows no metric), and any other error propagates (the caller turns it into the trial's one line). ``ctx``: a
    context of the caller's (a trial's sandboxed payload: ``workers.on_ray.trial_bridge``)."""
    from workers.train.gpu_share import claim_device
    from workers.train.loop import train
    from workers.train.shared import TrainingDiverged

    ctx = ctx or TrialContext(device=claim_device(spec), sink=sink)  # its share of the card fenced first
    try:
        train(spec, ctx)
    except TrainingDiverged as err:
        ctx.save({"failed": str(err)}, {"failed": True, "reason": str(err)})
    finally:
        sink.close()
