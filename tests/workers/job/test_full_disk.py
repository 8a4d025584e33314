"""A full storage volume loses no checkpoint, on a 20 MiB tmpfs the test mounts (tests/conftest.py):
a checkpoint write that finds no space leaves the previous checkpoint whole and readable, no half-written one,
and ends the run with one line that says so (never retried: the next try would meet the same full disk)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from api_schemas import ExperimentSpec
from tests.conftest import fill
from tests.service.conftest import tiny
from workers.job.artifacts import PARTIAL_PREFIX, checkpoints
from workers.on_ray.driver import DriverContext, attempt, retried
from workers.train.context import read_checkpoint
from workers.train.failure import JobFailed, failure_reason
from workers.train.sinks import MemorySink


def test_a_write_into_a_full_volume_keeps_the_previous_checkpoint(small_volume: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLAB_CHECKPOINT_EVERY_S", "0")
    run_dir = small_volume / "job"
    ctx = DriverContext(MemorySink(), run_dir)
    weights = torch.ones(1_000_000)  # 4 MB a checkpoint
    ctx.save({"epoch": 1, "model": {"w": weights}}, {"epochs": 1})
    ctx.flush()
    fill(small_volume, leave_bytes=1_000_000)  # room for a quarter of the next one
    ctx.save({"epoch": 2, "model": {"w": 2 * weights}}, {"epochs": 2})
    with pytest.raises(JobFailed) as failed:
        ctx.flush()
    line = failure_reason(failed.value)
    assert line.startswith("checkpoint write failed: no space left on the storage volume (0.00 GB free at ")
    assert "its last checkpoint (checkpoint_" in line and line.endswith("then continue it (`tlab continue`)")
    assert not retried(failed.value)  # the next try would meet the same full disk
    kept = checkpoints([run_dir])
    assert len(kept) == 1 and not list(run_dir.glob(f"{PARTIAL_PREFIX}*"))  # no half-written one either
    state = read_checkpoint(kept[0])
    assert state["epoch"] == 1 and torch.equal(state["model"]["w"], weights)


class FillsTheVolume(MemorySink):
    """A sink that fills the volume once the run has reported ``after`` epochs."""

    def __init__(self, volume: Path, after: int) -> None:
        super().__init__()
        self.volume, self.after = volume, after

    def emit(self, record: dict[str, Any]) -> None:
        super().emit(record)
        if record.get("kind") == "epoch" and record["epoch"] + 1 == self.after:
            fill(self.volume, leave_bytes=1024)


def test_a_run_whose_checkpoint_finds_the_disk_full_ends_with_that_reason(small_volume: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLAB_CHECKPOINT_EVERY_S", "0")
    spec = ExperimentSpec.model_validate(tiny(training={"epochs": 6}, teleport={"enabled": False}))
    sink = FillsTheVolume(small_volume, after=2)
    with pytest.raises(JobFailed, match=r"^checkpoint write failed: no space left on the storage volume"):
        attempt(spec, DriverContext(sink, small_volume / "job"))
    kept = checkpoints([small_volume / "job"])
    assert len(kept) >= 1 and json.loads((kept[0] / "meta.json").read_text())["epoch"] in (1, 2)
    assert read_checkpoint(kept[0])["model"]  # whole: the run can be continued from it
    assert [r["epoch"] for r in sink.records if r.get("kind") == "epoch"][-1] <= 3  # it stopped there
