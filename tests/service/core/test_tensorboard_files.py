"""The TensorBoard files the scheduler writes, read back with TensorBoard's own reader: every epoch once (a record
written twice, as a resumed run could), teleports folded into their epoch, a sweep's HParams view, and a rewrite
that only appends (TensorBoard goes on reading a file from where it stopped)."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata

from service.core.tensorboard_files import FILE, write_job


def epoch(e: int, trial: str = "") -> dict:
    r = {"kind": "epoch", "epoch": e, "train_loss": 1.0 / (e + 1), "test_loss": 2.0 / (e + 1), "test_acc": 0.1 * e,
         "lr": 0.01, "grad_norm": 3.0, "seconds": 1.5 * (e + 1), "teleport_seconds": 0.5}
    return {**r, "trial": trial} if trial else r


def teleport(e: int, batch: int) -> dict:
    return {"kind": "teleport", "epoch": e, "batch": batch, "grad_norm_sq_before": 1.0, "grad_norm_sq_after": 3.0,
            "loss_before": 0.5, "loss_after": 0.5, "steps": 4, "stop_reason": "steps", "layers": []}


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_each_epoch_once_with_its_teleports(tmp_path: Path) -> None:
    records = [epoch(0), teleport(1, 0), teleport(1, 1), epoch(1), epoch(1), epoch(2)]  # epoch 1 twice
    assert write_job(tmp_path, records, start=1000.0) == 3
    got = scalars(tmp_path)
    for tag in ("loss/train", "loss/test", "accuracy/test", "train/lr", "train/grad_norm", "teleport/share"):
        assert [step for step, _ in got[tag]] == [0, 1, 2], tag
    assert got["teleport/moves"] == [(1, 8.0)]
    assert got["teleport/grad_norm_sq_after"] == [(1, 3.0)]


def test_a_rewrite_with_more_epochs_starts_with_the_bytes_before(tmp_path: Path) -> None:
    write_job(tmp_path, [epoch(0), epoch(1)], start=1000.0)
    before = (tmp_path / FILE).read_bytes()
    write_job(tmp_path, [epoch(0), epoch(1), epoch(2)], start=1000.0)
    assert (tmp_path / FILE).read_bytes().startswith(before)
    assert [s for s, _ in scalars(tmp_path)["loss/train"]] == [0, 1, 2]


def test_a_sweep_has_a_run_per_trial_and_the_hparams_view(tmp_path: Path) -> None:
    trials = {"t_00000": {"config": {"teleport.enabled": True, "optimizer.lr": 0.1}, "state": "succeeded"},
              "t_00001": {"config": {"teleport.enabled": False, "optimizer.lr": 0.01}, "state": "failed"}}
    records = [epoch(e, t) for t in trials for e in range(2)]
    assert write_job(tmp_path, records, 1000.0, trials, ended="succeeded") == 4
    root = EventAccumulator(str(tmp_path))
    root.Reload()
    experiment = metadata.parse_experiment_plugin_data(root.PluginTagToContent(metadata.PLUGIN_NAME)[
        metadata.EXPERIMENT_TAG])
    assert sorted(h.name for h in experiment.hparam_infos) == ["optimizer.lr", "teleport.enabled"]
    assert "loss/train" in {m.name.tag for m in experiment.metric_infos}
    for trial, row in trials.items():
        acc = EventAccumulator(str(tmp_path / trial))
        acc.Reload()
        content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
        start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
        assert start.hparams["optimizer.lr"].number_value == row["config"]["optimizer.lr"]
        end = metadata.parse_session_end_info_plugin_data(content[metadata.SESSION_END_INFO_TAG])
        assert end.status == (1 if row["state"] == "succeeded" else 2)  # STATUS_SUCCESS, STATUS_FAILURE
        assert [s for s, _ in scalars(tmp_path / trial)["loss/train"]] == [0, 1]
