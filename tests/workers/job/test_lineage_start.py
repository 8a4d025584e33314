"""A continued or forked job's driver starts from its parent's checkpoint (the job hash's ``start_from``) while it
has none of its own, then from its own; its epochs go on from the parent's, each reported once (the in-driver
path on a real Redis: no Ray needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from api_schemas import keys
from api_schemas.lineage import StartFrom
from tests.workers.on_ray.test_driver import epochs_of, starts_of
from tests.workers.test_run_entrypoint import put_job
from workers import run
from workers.job.artifacts import checkpoints
from workers.job.redis_sink import read_events

PARENT, CONT, FORK, ORPHAN = (f"18f3a2b4c5d-00000{i}" for i in range(4))
PLAIN = {"enabled": False}  # no teleport: a fork that changes only tau must redo the parent's epochs exactly


def start_from(url: str, job: str, parent: str, storage: Path, epoch: int) -> None:
    """What ``service.api.lineage`` writes: the parent's kept checkpoint after ``epoch``."""
    kept = {json.loads((p / "meta.json").read_text())["epoch"]: p.name for p in checkpoints([storage / parent])}
    start = StartFrom(job=parent, epoch=epoch, checkpoint=kept[epoch])
    redis.Redis.from_url(url).hset(keys.job(job), "start_from", start.model_dump_json())


def metrics(url: str, job: str) -> dict[int, dict[str, Any]]:
    return {e["data"]["epoch"]: e["data"] for e in read_events(url, job) if e["kind"] == "metric"}


def test_a_child_starts_from_its_parents_checkpoint_then_from_its_own(
    redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TLAB_KEEP_CHECKPOINTS", "2")
    put_job(redis_server, PARENT, training={"epochs": 3, "batch_size": 32}, teleport=PLAIN)
    run.run_job(PARENT, redis_server, str(tmp_path))
    parent = metrics(redis_server, PARENT)

    put_job(redis_server, CONT, training={"epochs": 5, "batch_size": 32}, teleport=PLAIN)
    start_from(redis_server, CONT, PARENT, tmp_path, 3)
    summary = run.run_job(CONT, redis_server, str(tmp_path))
    events = read_events(redis_server, CONT)
    assert epochs_of(events) == [3, 4] and starts_of(events) == [3]  # its own epochs only, each once
    cont = metrics(redis_server, CONT)
    # it went on from the parent's weights: its first loss is near the parent's last, far from a fresh start's
    assert abs(cont[3]["train_loss"] - parent[2]["train_loss"]) < abs(cont[3]["train_loss"] - parent[0]["train_loss"])
    assert cont[3]["seconds"] > parent[2]["seconds"]  # the clock goes on too: one curve on a seconds axis
    assert summary["epochs"] == 5  # the summary covers the parent's epochs and its own
    # requeued after its cluster vanished: its own checkpoints win over the parent's (the same summary, less the
    # peak memory of the process that wrote it: this attempt's)
    again = run.run_job(CONT, redis_server, str(tmp_path))
    assert again.pop("host_memory_peak_mb") > 0 and again == {k: v for k, v in summary.items()
                                                               if k != "host_memory_peak_mb"}
    assert starts_of(read_events(redis_server, CONT)) == [3, 5]

    put_job(redis_server, FORK, training={"epochs": 3, "batch_size": 32}, teleport={**PLAIN, "tau": 0.99})
    start_from(redis_server, FORK, PARENT, tmp_path, 2)
    run.run_job(FORK, redis_server, str(tmp_path))
    fork = metrics(redis_server, FORK)
    assert list(fork) == [2]
    # the same weights, optimizer state and data order as the parent had after epoch 2: the same epoch 3
    assert fork[2]["train_loss"] == pytest.approx(parent[2]["train_loss"], rel=1e-6)
    assert fork[2]["test_loss"] == pytest.approx(parent[2]["test_loss"], rel=1e-6)


def test_a_start_checkpoint_that_is_gone_fails_naming_it(redis_server: str, tmp_path: Path) -> None:
    put_job(redis_server, ORPHAN, training={"epochs": 3, "batch_size": 32}, teleport=PLAIN)
    start = StartFrom(job=PARENT, epoch=2, checkpoint="checkpoint_2026-01-01_00-00-00.000001")
    redis.Redis.from_url(redis_server).hset(keys.job(ORPHAN), "start_from", start.model_dump_json())
    with pytest.raises(ValueError, match=f"experiment {PARENT} after epoch 2.*is gone"):
        run.run_job(ORPHAN, redis_server, str(tmp_path))
    assert metrics(redis_server, ORPHAN) == {}  # it did not quietly train from scratch
