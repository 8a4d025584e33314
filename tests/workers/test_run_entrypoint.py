"""``python -m workers.run --job ID``: the scheduler's entrypoint, on a real Redis and a real local Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from api_schemas import build_spec, keys
from workers import run
from workers.redis_sink import read_events


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
