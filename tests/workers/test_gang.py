"""A multi-worker job as a gang its driver leads (``workers.gang``) on a real local Ray and a real Redis: it
trains exactly as Ray Train's worker group did (same shards, same DDP, same teleport: the same losses), every
epoch once, rank 0 the only writer of checkpoints, each rank's log kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from tests.workers.test_run_entrypoint import put_job
from workers import run, startup
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
    startup.begin()  # what the job's entrypoint does first (workers.run.job_main)
    gang = run.run_job("gang", redis_server, str(tmp_path / "a"), max_failures=0)
    phases = startup.timeline()  # rank 0's start-up, every phase, in order
    assert list(phases) == list(startup.PHASES) and sorted(phases.values()) == list(phases.values()), phases
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


def test_a_killed_rank_fails_the_try_and_the_gang_resumes_every_epoch_once(
    ray_local: Any, redis_server: str, tmp_path: Path
) -> None:
    import os
    import signal
    import threading
    import time

    import psutil

    put_job(redis_server, "kill", **{**GANG, "training": {"epochs": 8, "batch_size": 32}})
    outcome: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: outcome.setdefault(
        "summary", run.run_job("kill", redis_server, str(tmp_path), max_failures=1)))
    runner.start()
    deadline = time.monotonic() + 120
    while len(epochs(read_events(redis_server, "kill"))) < 2:
        assert time.monotonic() < deadline and runner.is_alive(), "the gang reported no 2 epochs"
        time.sleep(0.05)
    rank1 = [p for p in psutil.process_iter(["cmdline"]) if "ray::gang_rank" in " ".join(p.info["cmdline"] or [])]
    assert len(rank1) == 1, rank1  # Ray titles a task's process by its function while it runs
    os.kill(rank1[0].pid, signal.SIGKILL)
    runner.join(timeout=240)
    assert not runner.is_alive() and outcome["summary"]["epochs"] == 8
    events = read_events(redis_server, "kill")
    assert epochs(events) == list(range(8))  # the retry redid nothing it had reported
    starts = [e["data"]["resumed_from_epoch"] for e in events if e["data"].get("kind") == "start"]
    assert len(starts) == 2 and starts[1] >= 1, starts  # from its last checkpoint, not from scratch
    assert any("retry 1 of TLAB_MAX_FAILURES=1" in e["data"].get("message", "") for e in events)


def test_a_rank_that_cannot_start_fails_the_try_at_once_not_after_the_gang_timeout(
    ray_local: Any, redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    import ray

    from api_schemas import ExperimentSpec, keys
    from workers.driver import run_in_driver

    monkeypatch.setenv("TLAB_GANG_TIMEOUT_S", "600")
    put_job(redis_server, "gone", **GANG)
    with redis.Redis.from_url(redis_server) as client:
        spec = ExperimentSpec.model_validate_json(client.hget(keys.job("gone"), "spec"))
    head = ray.get_runtime_context().get_node_id()
    start = time.monotonic()
    with pytest.raises(Exception, match="(?i)node|unschedulable|infeasible"):  # rank 1 planned on a node gone
        run_in_driver(spec, "gone", redis_server, tmp_path, max_failures=0, placement=[head, "ab" * 28])
    assert time.monotonic() - start < 60  # not TLAB_GANG_TIMEOUT_S
