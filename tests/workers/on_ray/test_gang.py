"""A multi-worker job as a gang its driver leads (``workers.on_ray.gang``) on a real local Ray and a real Redis: it
trains exactly as Ray Train's worker group did (same shards, same DDP, same teleport: the same losses), every
epoch once, rank 0 the only writer of checkpoints, each rank's log kept."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from tests.workers.test_run_entrypoint import put_job
from workers import run
from workers.job.artifacts import checkpoints
from workers.job.redis_sink import read_events
from workers.train import startup

GANG = {"resources": {"workers": 2, "cpus_per_worker": 1}, "training": {"epochs": 3, "batch_size": 32},
        "teleport": {"epochs": [1], "batches": 1, "steps": 2, "batch_size": 16, "budget": None}}


def losses(events: list[dict[str, Any]]) -> list[float]:
    return [e["data"][k] for e in events if e["kind"] == "metric" for k in ("train_loss", "test_loss")]


def epochs(events: list[dict[str, Any]]) -> list[int]:
    return [e["data"]["epoch"] for e in events if e["kind"] == "metric"]


def test_a_gang_trains_as_ray_trains_worker_group_did_every_epoch_once(
    ray_local: Any, redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TLAB_STORAGE", str(tmp_path))
    put_job(redis_server, "gang", **GANG)
    startup.begin()  # what the job's entrypoint does first (workers.job.harness.job_main)
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


def start_driver(ray_local: Any, redis_url: str, storage: Path, job: str) -> tuple[subprocess.Popen, Path]:
    """``python -m workers.run --job JOB`` in its own process, as the scheduler's Ray job runs it, on the session's
    cluster: whatever ends it (a native abort too) fails the test with its output, never the pytest worker. The
    output (``-X faulthandler``: a crash's Python stacks too) is kept in a file."""
    env = {**os.environ, "REDIS_URL": redis_url, "TLAB_STORAGE": str(storage), "TLAB_MAX_FAILURES": "1",
           "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "disabled"}
    log = storage / "driver.out"
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "workers.run", "--job", job], env=env,
                                stdout=out, stderr=subprocess.STDOUT), log


def ended(driver: subprocess.Popen, log: Path) -> str:
    """The driver's exit status and the end of its output, for an assertion's message."""
    return f"driver exit status {driver.poll()}; its output ends:\n{log.read_text(errors='replace')[-4000:]}"


KILL_EPOCHS = 30


@pytest.mark.drill
def test_a_killed_rank_fails_the_try_and_the_gang_resumes_every_epoch_once(
    ray_local: Any, redis_server: str, tmp_path: Path
) -> None:
    """Rank 1 SIGKILLed after 2 epochs: the driver (its own process, as in production) fails the try and retries
    it from its last checkpoint, and the job ends with every epoch reported once."""
    import psutil

    # 30 epochs of tens of ms: under a full suite's load, 8 ended before the kill landed (one start, no retry)
    put_job(redis_server, "kill", **{**GANG, "training": {"epochs": KILL_EPOCHS, "batch_size": 32}})
    driver, log = start_driver(ray_local, redis_server, tmp_path, "kill")
    try:
        deadline = time.monotonic() + 120
        while len(epochs(read_events(redis_server, "kill"))) < 2:
            if driver.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the gang reported no 2 epochs: {ended(driver, log)}")
            time.sleep(0.05)
        header = (tmp_path / "kill" / "logs" / "attempt-1" / "rank-1.log").read_text().splitlines()[0]
        rank1 = psutil.Process(int(re.search(r"pid (\d+) on", header)[1]))  # its log's first line names it
        assert "ray::gang_rank" in " ".join(rank1.cmdline()), header  # Ray titles a task's process by its function
        rank1.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # within pytest's 300 s, so the message is ours
            driver.wait(timeout=150)
        assert driver.poll() == 0, ended(driver, log)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    events = read_events(redis_server, "kill")
    assert epochs(events) == list(range(KILL_EPOCHS))  # the retry redid nothing it had reported
    assert events[-1]["data"]["state"] == "finished" and events[-1]["data"]["summary"]["epochs"] == KILL_EPOCHS
    starts = [e["data"]["resumed_from_epoch"] for e in events if e["data"].get("kind") == "start"]
    assert len(starts) == 2 and starts[1] >= 1, starts  # from its last checkpoint, not from scratch
    assert any("retry 1 of TLAB_MAX_FAILURES=1" in e["data"].get("message", "") for e in events)


GET_THEN_END = """
import ray
from workers.on_ray.gang_start import end_tasks

ray.init(log_to_driver=False)  # RAY_ADDRESS: the session's cluster


@ray.remote(max_retries=0)
def rank() -> None:
    return None


for _ in range(300):
    refs = [rank.remote() for _ in range(2)]
    ray.get(refs)
    end_tasks(refs, 1.0)
print("lived")
"""


def test_ending_ranks_that_ended_never_cancels_them(ray_local: Any) -> None:
    """A failed try's ranks are ended with ``end_tasks``, and a gang's that ended are never cancelled: Ray aborts
    the process that cancels a task whose reply it is still handling (a bare ``ray.cancel`` after ``ray.get``
    died within 212 rounds in 8 runs of 8). In a process of its own: such an abort fails only this test."""
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", GET_THEN_END], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("lived"), done.stderr[-4000:]


@pytest.mark.timeout(120)
def test_a_rank_that_cannot_start_fails_the_try_at_once_not_after_the_gang_timeout(
    ray_local: Any, redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from api_schemas import ExperimentSpec, keys
    from workers.on_ray.tries import run_in_driver

    monkeypatch.setenv("TLAB_GANG_TIMEOUT_S", "600")
    put_job(redis_server, "gone", **GANG)
    with redis.Redis.from_url(redis_server) as client:
        spec = ExperimentSpec.model_validate_json(client.hget(keys.job("gone"), "spec"))
    head = ray.get_runtime_context().get_node_id()
    with pytest.raises(Exception, match="(?i)node|unschedulable|infeasible") as failed:  # rank 1 on a node gone
        run_in_driver(spec, "gone", redis_server, tmp_path, max_failures=0, placement=[head, "ab" * 28])
    assert "TLAB_GANG_TIMEOUT_S" not in str(failed.value)  # its own reason, not the others' wait (the test's
    # timeout, well under the 600 s wait, fails a run that waited for it)


def test_a_rank_that_failed_of_its_own_fails_the_job_and_one_that_died_retries_the_try(ray_local: Any) -> None:
    """A rank's payload whose error is the job's own (its memory limit, its code: ``supervise_rank`` raises
    ``JobFailed``) ends the try without a retry, which would meet it again; any other error of a rank retries."""
    import ray

    from workers.on_ray.supervisor import rank_failure
    from workers.train.failure import JobFailed

    @ray.remote(max_retries=0)
    def failing(own: bool) -> None:
        raise (JobFailed if own else RuntimeError)("the training held 0.15 GiB of host memory, over "
                                                   "resources.memory_gb=0.1")

    for own in (True, False):
        ranks = SimpleNamespace(refs=[failing.remote(own)])
        ray.wait(ranks.refs)
        ended = rank_failure(ranks)
        assert ended is not None and ended.retried is not own and ranks.refs == []
        assert ended.error.startswith("a rank of the gang failed: ") and "resources.memory_gb=0.1" in ended.error
    assert rank_failure(SimpleNamespace(refs=[])) is None
