"""A 1-worker sweep trial trains in the Tune trial itself (``workers.on_ray.trial``): what it holds in Ray, where its
checkpoints live, and a real Tune run whose trial fails mid-way and goes on from its last reported checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api_schemas import build_spec, gate
from api_schemas.sweeps import SweepSubmit
from workers.job.artifacts import last_training_state
from workers.on_ray.trial import in_trial, train_in_trial, trial_dirs, trial_resources
from workers.train.shared import summarize
from workers.train.sinks import JsonlSink

TINY = {"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [16]},
        "training": {"epochs": 3, "batch_size": 128, "max_steps_per_epoch": 3}, "teleport": {"enabled": False},
        "resources": {"cpus_per_worker": 0.5}}


def sweep_of(base: dict[str, Any], space: dict[str, Any] | None = None) -> SweepSubmit:
    return SweepSubmit.model_validate({"base": base, "search_space": space or {"training.seed": {"grid": [0, 1]}}})


def test_one_worker_trials_train_in_the_trial_holding_the_workers_resources(monkeypatch: pytest.MonkeyPatch) -> None:
    one = sweep_of(TINY)
    assert in_trial(one) and trial_resources(one) == {"cpu": 0.5}
    gpu = sweep_of({**TINY, "resources": {"cpus_per_worker": 1, "gpus_per_worker": 0.5}})
    assert trial_resources(gpu) == {"cpu": 1, "gpu": 0.5}
    h100 = sweep_of({**TINY, "resources": {"cpus_per_worker": 1, "gpus_per_worker": 0.25, "gpu_type": "H100"}})
    assert trial_resources(h100) == {"cpu": 1, "gpu": 0.25, "accelerator_type:H100": 0.001}  # on an H100 node
    held = sweep_of({**TINY, "resources": {"cpus_per_worker": 1, "memory_gb": 1.5}})  # the scheduler counts it
    assert trial_resources(held) == {"cpu": 1, "memory": 1.5 * 2**30}
    assert not in_trial(sweep_of({**TINY, "resources": {"workers": 2, "cpus_per_worker": 0.5}}))
    assert not in_trial(sweep_of(TINY, {"resources.workers": {"grid": [1, 2]}}))  # drawn: a TorchTrainer each
    monkeypatch.setenv("TLAB_IN_DRIVER", "0")
    assert not in_trial(one)


def test_trial_dirs_are_the_trials_own_tune_directories(tmp_path: Path) -> None:
    for name in ("own_trial_ab12c_00000_0_seed=0", "own_trial_ab12c_00001_1_seed=1"):
        (tmp_path / "sweep-job1" / name).mkdir(parents=True)
    (tmp_path / "sweep-job2" / "own_trial_ab12c_00000_0_seed=0").mkdir(parents=True)
    assert [p.name for p in trial_dirs(tmp_path, "job1", "ab12c_00000")] == ["own_trial_ab12c_00000_0_seed=0"]
    assert trial_dirs(tmp_path, "job3", "ab12c_00000") == []
    # a trial id that is no Tune id (a forged trials row's) names no directory; a link there is none of the sweep's
    with pytest.raises(gate.Refused):
        trial_dirs(tmp_path, "job1", "/../../job2")
    (tmp_path / "sweep-job1" / "own_trial_ab12c_00002_link").symlink_to(tmp_path / "sweep-job2")
    assert trial_dirs(tmp_path, "job1", "ab12c_00002") == []


class FailOnce(JsonlSink):
    """Records to a file; the first time epoch 1 arrives (no marker yet) the trial's process fails."""

    def emit(self, record: dict[str, Any]) -> None:
        marker = self.path.with_name("failed")
        if record.get("kind") == "epoch" and record["epoch"] == 1 and not marker.exists():
            marker.write_text("once")
            raise ConnectionError("the trial lost its connection")
        super().emit(record)


def failing_trial(config: dict[str, Any]) -> None:
    train_in_trial(build_spec(TINY), FailOnce(Path(config["out"]) / "metrics.jsonl"))


def test_a_trial_retried_by_tune_goes_on_from_its_last_checkpoint_with_every_epoch_once(
    ray_local: object, tmp_path: Path
) -> None:
    from ray import tune

    tuner = tune.Tuner(tune.with_resources(failing_trial, {"cpu": 0.5}), param_space={"out": str(tmp_path)},
                       run_config=tune.RunConfig(name="sweep-job", storage_path=str(tmp_path / "storage"),
                                                 failure_config=tune.FailureConfig(max_failures=1),
                                                 checkpoint_config=tune.CheckpointConfig(num_to_keep=2)))
    (result,) = tuner.fit()
    assert result.error is None and (tmp_path / "failed").exists()  # it failed once and Tune started it again
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1, 2]  # once each, in order
    assert [r["resumed_from_epoch"] for r in records if r["kind"] == "start"] == [0, 1]  # from epoch 0's checkpoint
    history = [r for r in records if r["kind"] == "epoch"]
    # what Tune saw is the run's summary, as TuneReportCallback forwarded it from a TorchTrainer
    expected = {k: v for k, v in summarize(history, None, 0).items() if v is not None}
    assert set(expected) >= {"epochs", "final_train_loss", "seconds"}
    assert {k: result.metrics[k] for k in expected} == pytest.approx(expected)
    dirs = trial_dirs(tmp_path / "storage", "job", result.metrics["trial_id"])
    found = last_training_state(dirs)
    assert found is not None and found[1]["epoch"] == 3 and "model" in found[1], dirs


def test_a_payload_whose_supervisor_is_gone_ends_as_a_stop(tmp_path: Path) -> None:
    """The bridge's report waits for the supervisor's answer; when the trial's process has ended (ASHA stopped the
    trial) the pipe is closed and the payload's try ends as a stop — no error, no traceback in the trial's log."""
    import os

    from workers.job.orders import Stopped
    from workers.on_ray.trial_bridge import BridgedTrialContext

    (r_rep, w_rep), (r_ans, w_ans) = os.pipe(), os.pipe()
    with os.fdopen(w_rep, "wb") as reports, os.fdopen(r_ans, "rb") as answers, os.fdopen(r_rep, "rb") as seen:
        ctx = BridgedTrialContext(reports=reports, answers=answers, scratch=tmp_path, restore_from=None)
        with os.fdopen(w_ans, "wb") as supervisor:
            supervisor.write(b"ok\n")
            supervisor.flush()
            ctx.report_metrics({"epoch": 0, "train_loss": 1.5})  # answered: training goes on
        assert json.loads(seen.readline()) == {"metrics": {"epoch": 0, "train_loss": 1.5}, "checkpoint": None}
        with pytest.raises(Stopped, match="supervisor is gone"):
            ctx.report_metrics({"epoch": 1, "train_loss": 1.4})  # the answer pipe is closed: nobody will answer
