"""A multi-worker job as a gang its driver leads (``workers.gang``) on a real local Ray and a real Redis: it
trains exactly as Ray Train's worker group did (same shards, same DDP, same teleport: the same losses), every
epoch once, rank 0 the only writer of checkpoints, each rank's log kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.workers.test_run_entrypoint import put_job
from workers import run
from workers.artifacts import checkpoints
from workers.redis_sink import read_events

GANG = {"resources": {"workers": 2, "cpus_per_worker": 1}, "training": {"epochs": 3, "batch_size": 32},
        "teleport": {"epochs": [1], "batches": 1, "steps": 2, "batch_size": 16}}


def losses(events: list[dict[str, Any]]) -> list[float]:
    return [e["data"][k] for e in events if e["kind"] == "metric" for k in ("train_loss", "test_loss")]


def epochs(events: list[dict[str, Any]]) -> list[int]:
    return [e["data"]["epoch"] for e in events if e["kind"] == "metric"]


def test_a_gang_trains_as_ray_trains_worker_group_did_every_epoch_once(
    ray_local: Any, redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TLAB_STORAGE", str(tmp_path))
    put_job(redis_server, "gang", **GANG)
    gang = run.run_job("gang", redis_server, str(tmp_path / "a"), max_failures=0)
    monkeypatch.setenv("TLAB_IN_DRIVER", "0")  # the same spec as a TorchTrainer
    put_job(redis_server, "trainer", **GANG)
    trainer = run.run_job("trainer", redis_server, str(tmp_path / "b"), max_failures=0)

    ours, theirs = read_events(redis_server, "gang"), read_events(redis_server, "trainer")
    assert epochs(ours) == epochs(theirs) == [0, 1, 2]  # every epoch once
    assert losses(ours) == pytest.approx(losses(theirs), rel=1e-6)  # the same training, epoch by epoch
    teleports = [e["data"] for e in ours if e["kind"] == "teleport"]
    assert len(teleports) == 1 and teleports[0]["epoch"] == 1
    assert gang["epochs"] == trainer["epochs"] == 3
    assert len(checkpoints([tmp_path / "a" / "gang"])) >= 1
    assert (tmp_path / "a" / "gang" / "logs" / "attempt-1" / "rank-1.log").is_file()  # rank 0's: the driver's
