"""``python -m workers.run --job ID``: the scheduler's entrypoint, on a real Redis and a real local Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from api_schemas import build_spec, keys
from workers import run
from workers.job.redis_sink import read_events


def put_job(url: str, job: str, **overrides: object) -> None:
    spec = build_spec({
        "model": {"kind": "mlp", "hidden": [32]},
        "dataset": {"name": "digits", "max_train": 200, "max_test": 100},
        "optimizer": {"name": "sgd", "lr": 0.05},
        "training": {"epochs": 2, "batch_size": 32},
        "teleport": {"epochs": [0], "batches": 1, "steps": 2},
        "resources": {"workers": 1, "cpus_per_worker": 0.5},
        **overrides,
    })
    client = redis.Redis.from_url(url)
    client.hset(keys.job(job), mapping={"spec": spec.model_dump_json(), "state": "starting"})
    client.close()


def test_missing_environment_and_unknown_job_exit_2_with_what_to_set(
    redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("TLAB_STORAGE", str(tmp_path))
    assert run.main(["--job", "x"]) == 2
    assert "REDIS_URL is not set" in capsys.readouterr().err
    monkeypatch.setenv("REDIS_URL", redis_server)
    assert run.main(["--job", "nope"]) == 2
    assert "job nope has no spec in Redis" in capsys.readouterr().err
    assert [e["data"].get("message", "") for e in read_events(redis_server, "nope")][-1].startswith("job nope")


@pytest.fixture()
def job_env(redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the scheduler puts in a Ray job's runtime_env."""
    monkeypatch.setenv("REDIS_URL", redis_server)
    monkeypatch.setenv("TLAB_STORAGE", str(tmp_path))
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


@pytest.mark.slow
def test_a_job_runs_on_ray_and_leaves_events_and_summary(
    ray_local: object, redis_server: str, job_env: None
) -> None:
    put_job(redis_server, "ok")
    assert run.main(["--job", "ok"]) == 0
    events = read_events(redis_server, "ok")
    assert events[0]["kind"] == "status" and events[0]["data"]["state"] == "running"
    assert [e["data"]["epoch"] for e in events if e["kind"] == "metric"] == [0, 1]
    assert events[-1]["data"]["state"] == "finished"
    summary = json.loads(redis.Redis.from_url(redis_server).hget(keys.job("ok"), "summary"))
    assert summary["epochs"] == 2 and summary["final_train_loss"] > 0


@pytest.mark.slow
def test_a_diverging_job_fails_once_with_the_epoch_and_reason(
    ray_local: object, redis_server: str, job_env: None
) -> None:
    put_job(redis_server, "nan", optimizer={"name": "sgd", "lr": 1e30}, teleport={"enabled": False})
    assert run.main(["--job", "nan"]) == 1
    events = read_events(redis_server, "nan")
    starts = [e for e in events if e["kind"] == "status" and e["data"].get("kind") == "start"]
    assert len(starts) == 1  # not retried: it would diverge again from its checkpoint
    assert "diverged at epoch 0" in events[-1]["data"]["message"]
    assert redis.Redis.from_url(redis_server).hget(keys.job("nan"), "summary") is None


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_job_over_its_memory_gb_is_killed_once_saying_what_it_held(
    ray_local: object, redis_server: str, job_env: None, workers: int
) -> None:
    """resources.memory_gb is held, not only reserved: 0.1 GiB is less than torch's import (~0.2 GiB resident); the
    payload is killed, the job fails once (a retry would hold as much), naming the field and what to set. A gang's
    rank over it (rank 0 in the driver, rank 1 a Ray task) fails the job the same way, without a retry."""
    put_job(redis_server, "big", resources={"workers": workers, "cpus_per_worker": 0.5, "memory_gb": 0.1})
    assert run.main(["--job", "big"]) == 1
    events = read_events(redis_server, "big")
    assert not [e for e in events if "retry" in str(e["data"].get("message", ""))]
    reason = events[-1]["data"]["message"]
    assert "GiB of host memory, over resources.memory_gb=0.1: raise resources.memory_gb" in reason, reason
    assert redis.Redis.from_url(redis_server).hget(keys.job("big"), "summary") is None


def metric_values(url: str, job: str) -> list[tuple[float, ...]]:
    """Each epoch's numbers, as the job's stream has them (times left out: they differ run to run)."""
    return [(e["data"]["epoch"], e["data"]["train_loss"], e["data"]["test_loss"], e["data"]["test_acc"])
            for e in read_events(url, job) if e["kind"] == "metric"]


@pytest.mark.slow
def test_in_driver_and_torchtrainer_give_the_same_epochs_and_summary_keys(
    ray_local: object, redis_server: str, job_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank, the same seeds: the driver path is the TorchTrainer path without the worker group, bit for bit.
    The TorchTrainer job runs as the scheduler starts it: its own Redis user, reached through a one-time ticket
    (no ``REDIS_URL`` in its environment; its workers get the URL in ``train_loop_config``)."""
    from service.core.settings import Settings
    from service.launch.job_acl import JobAcl

    overrides = {"training": {"epochs": 3, "batch_size": 32}}
    put_job(redis_server, "driver", **overrides)
    put_job(redis_server, "trainer", **overrides)
    assert run.main(["--job", "driver"]) == 0
    acl = JobAcl(redis.Redis.from_url(redis_server, decode_responses=True), Settings(redis_url=redis_server))
    monkeypatch.setenv(keys.JOB_TICKET_ENV, acl.credentials("trainer", "tlab-trainer-1")[keys.JOB_TICKET_ENV])
    monkeypatch.delenv("REDIS_URL")
    monkeypatch.setenv("TLAB_IN_DRIVER", "0")
    assert run.main(["--job", "trainer"]) == 0
    acl.keep_summary("trainer")  # what the scheduler does once the Ray job ended
    in_driver, trainer = metric_values(redis_server, "driver"), metric_values(redis_server, "trainer")
    assert len(in_driver) == 3 and in_driver == trainer  # exactly equal, not close
    client = redis.Redis.from_url(redis_server)
    summaries = [json.loads(client.hget(keys.job(j), "summary")) for j in ("driver", "trainer")]
    assert sorted(summaries[0]) == sorted(summaries[1])  # what Ray Train's result.metrics gave
    assert summaries[0]["final_train_loss"] == summaries[1]["final_train_loss"]
    assert "checkpoint" in startup_phases(redis_server, "driver")  # every phase of a 1-worker driver
    assert list(startup_phases(redis_server, "trainer")) == ["spawned", "driver", "torch"]  # loop: Ray Train's


def startup_phases(url: str, job: str) -> dict[str, float]:
    """The ``finished`` event's start-up timeline (``workers.train.startup``), checked against the stream's own times:
    in order, the driver's start before its ``running`` event, the first checkpoint after the first epoch's."""
    events = read_events(url, job)
    phases = events[-1]["data"]["startup"]
    assert list(phases.values()) == sorted(phases.values()), phases
    stream_s = {e["kind"]: int(e["id"].split("-")[0]) / 1000 for e in reversed(events)}  # each kind's first
    assert phases["spawned"] <= phases["driver"] <= stream_s["status"] + 0.001
    if "checkpoint" in phases:
        assert list(phases) == ["spawned", "driver", "torch", "data", "model", "checkpoint"]
        assert phases["checkpoint"] >= stream_s["metric"] - 0.001
    return phases


def start_driver(url: str, job: str, epochs: int) -> subprocess.Popen[bytes]:
    """``python -m workers.run --job JOB`` as the Ray job's entrypoint runs it, once it has reported ``epochs``."""
    proc = subprocess.Popen([sys.executable, "-m", "workers.run", "--job", job], env=dict(os.environ))
    deadline = time.monotonic() + 120
    while len(metric_values(url, job)) < epochs:
        assert proc.poll() is None and time.monotonic() < deadline, f"the driver ended before epoch {epochs}"
        time.sleep(0.02)
    return proc


@pytest.mark.slow
def test_a_stopped_driver_is_not_retried_and_exports_its_artifacts(
    redis_server: str, tmp_path: Path, job_env: None
) -> None:
    """SIGTERM (a cancel, a time limit) unwinds the loop without a retry; the artifacts are written in the grace."""
    put_job(redis_server, "stopped", training={"epochs": 100_000, "batch_size": 32, "max_steps_per_epoch": 1},
            teleport={"enabled": False})
    proc = start_driver(redis_server, "stopped", epochs=3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    events = read_events(redis_server, "stopped")
    assert len([e for e in events if e["data"].get("kind") == "start"]) == 1
    assert "stopped by the scheduler" in events[-1]["data"]["message"]
    run_dir = tmp_path / "stopped"
    summary = json.loads((run_dir / "artifacts" / "summary.json").read_text())
    # the last checkpoint's: an epoch is reported just before its checkpoint is saved, so the stop that came
    # after the third report may have found the second epoch's checkpoint the newest (CI saw 2 once)
    newest = json.loads(sorted(run_dir.glob("checkpoint_*"))[-1].joinpath("meta.json").read_text())
    assert summary["complete"] is False and summary["epochs"] == newest["epoch"] >= 2
    assert not list(run_dir.glob(".tmp-*"))  # a save the stop interrupted left nothing behind


@pytest.mark.slow
@pytest.mark.drill
def test_a_driver_killed_mid_run_resumes_from_its_checkpoint_with_every_epoch_once(
    redis_server: str, tmp_path: Path, job_env: None
) -> None:
    """SIGKILL (no grace, no cleanup) between epochs; the next attempt goes on from the last whole checkpoint."""
    epochs = 150
    put_job(redis_server, "killed", dataset={"name": "digits"}, training={"epochs": epochs, "batch_size": 32},
            teleport={"enabled": False})
    proc = start_driver(redis_server, "killed", epochs=3)
    proc.kill()
    proc.wait(timeout=30)
    reported = len(metric_values(redis_server, "killed"))
    assert reported < epochs, "the run finished before the kill: raise epochs"
    assert run.main(["--job", "killed"]) == 0
    events = read_events(redis_server, "killed")
    assert [m[0] for m in metric_values(redis_server, "killed")] == list(range(epochs))
    resumed = [e["data"]["resumed_from_epoch"] for e in events if e["data"].get("kind") == "start"]
    assert resumed[0] == 0 and 0 < resumed[1] <= reported
    summary = json.loads((tmp_path / "killed" / "artifacts" / "summary.json").read_text())
    assert summary["complete"] and summary["epochs"] == epochs
