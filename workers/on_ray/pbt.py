"""PBT for trials that train through a Ray Train TorchTrainer (several workers, or ``TLAB_IN_DRIVER=0``):
Tune's scheduler holding no round on a trial's last result, and the trial function that trains
``perturbation_interval`` epochs per TorchTrainer and hands each one's checkpoint to Tune."""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

from api_schemas.sweeps import SweepSubmit, trial_spec


def pbt_scheduler(epochs: int, **kw: Any) -> Any:
    """Tune's PBT, holding no round on a trial's last result: a trial moved there would only restart with
    nothing left to train, and its row would show a config its results never trained under."""
    from ray.tune.schedulers import PopulationBasedTraining

    class PBT(PopulationBasedTraining):
        def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
            if result.get(self._time_attr, 0) >= epochs:
                return self.CONTINUE
            return super().on_trial_result(tune_controller, trial, result)

    return PBT(**kw)


def checkpoint_epoch(checkpoint: Any) -> int:
    """The epoch a training checkpoint goes on from (0 for none)."""
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as path, open(os.path.join(path, "meta.json")) as f:  # RayTrainContext.save
        return int(json.load(f)["epoch"])


def pbt_trainable(sweep: SweepSubmit, job_id: str, redis_url: str, storage: str) -> Callable[[dict[str, Any]], None]:
    """The trial function of a PBT sweep whose trials train through TorchTrainers."""
    from ray import tune

    from workers.on_ray.ray_train import build_trainer

    base = sweep.base.model_dump(mode="json")

    def trial(config: dict[str, Any]) -> None:
        # PBT needs a Tune checkpoint to copy from one trial to another, and TuneReportCallback forwards
        # only metrics: so the trial trains perturbation_interval epochs at a time, one TorchTrainer each,
        # and reports the trainer's last checkpoint to Tune between them. After an exploit Tune restarts
        # the trial with the top trial's checkpoint and the mutated config, and it goes on from there.
        trial_id = tune.get_context().get_trial_id()
        copies = os.path.join(storage, f"pbt-{job_id}")
        # what earlier starts of this trial left (PBT stops and restarts trials): Tune keeps its own copies
        # of every checkpoint the trial reported, so these training runs are not needed again
        stale = glob.glob(os.path.join(storage, f"{job_id}-{trial_id}-*")) + glob.glob(
            os.path.join(copies, f"{trial_id}-*"))
        # scratch: the directory of ours the checkpoint to go on from lives in (a copy of an exploited
        # checkpoint, then the last interval's run), removed once the next run has gone on from it
        checkpoint, scratch = tune.get_checkpoint(), None
        done, total = checkpoint_epoch(checkpoint), trial_spec(base, config).training.epochs
        if checkpoint is not None and done < total:
            # another trial's checkpoint (an exploit) lives in that trial's directory, where Tune may delete
            # it while this trial starts up: take a copy of our own first
            scratch = os.path.join(copies, f"{trial_id}-{uuid.uuid4().hex[:8]}")
            checkpoint = tune.Checkpoint.from_directory(checkpoint.to_directory(scratch))
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        while done < total:
            stop = min((done // sweep.perturbation_interval + 1) * sweep.perturbation_interval, total)
            spec = trial_spec(base, {**config, "training.epochs": stop})
            # a fresh run name: Ray Train would otherwise resume the name's own last checkpoint instead
            run = f"{job_id}-{trial_id}-{uuid.uuid4().hex[:8]}"
            trainer = build_trainer(spec, name=run, storage_path=storage, redis_url=redis_url, job_id=job_id,
                                    trial=trial_id, resume_from=checkpoint)
            result = trainer.fit()
            if scratch is not None:  # Tune keeps its own copies of what was reported
                shutil.rmtree(scratch, ignore_errors=True)
            scratch = os.path.join(storage, run)
            metrics = dict(result.metrics or {})
            if metrics.get("failed") or result.checkpoint is None:
                raise RuntimeError(f"trial {trial_id}: {metrics.get('reason') or 'the run left no checkpoint'}")
            checkpoint = tune.Checkpoint(path=result.checkpoint.path, filesystem=result.checkpoint.filesystem)
            tune.report(metrics, checkpoint=checkpoint)
            done = stop

    return trial
