"""Fencing, with real job processes: a job's driver (``python -m workers.run``: supervisor, payload, checkpoint writer,
export) is frozen mid-run (SIGSTOP on its process group, as a host cut off keeps its processes), the service requeues
the job and starts it again; continued (the host healed) while the next attempt trains, and after the job succeeded,
the frozen attempts write nothing: the stream holds each epoch once, the checkpoints an ended attempt kept are those
it wrote while current, the artifacts and the summary are the last attempt's (sha256 checked), and each frozen
process ends itself. Real Redis; no Ray (a 1-worker job trains in its driver's payload)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from api_schemas import keys
from api_schemas.jobs import ExperimentSubmit, JobState
from api_schemas.spec import ExperimentSpec
from service.core.store import Store
from tests.service.conftest import tiny
from workers.job.artifacts import checkpoint_attempt
from workers.job.harness import ENDED_EXIT
from workers.job.redis_sink import read_events

EPOCHS = 100
SPEC = ExperimentSpec.model_validate(tiny(training={"epochs": EPOCHS, "batch_size": 32},
                                          dataset={"max_train": 300, "max_test": 50}))


def wait(ok: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def driver(redis_url: str, storage: Path, job: str, log: Path) -> subprocess.Popen:
    """The Ray job's entrypoint as the scheduler submits it, in a process group of its own (its payload in it)."""
    env = {**os.environ, "REDIS_URL": redis_url, "TLAB_STORAGE": str(storage), "TLAB_SANDBOX": "off",
           "TLAB_CHECKPOINT_EVERY_S": "0", "OMP_NUM_THREADS": "1"}
    env.pop(keys.JOB_TICKET_ENV, None)
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "workers.run", "--job", job], env=env, start_new_session=True,
                                stdout=out, stderr=subprocess.STDOUT)


def epochs(redis_url: str, job: str) -> list[int]:
    return [e["data"]["epoch"] for e in read_events(redis_url, job) if e["kind"] == "metric"]


def start(store: Store, job: str, attempt: int) -> None:
    assert store.transition(job, JobState.STARTING, expect=[JobState.QUEUED], attempts=str(attempt),
                            ray_job_id=f"tlab-{job}-{attempt}")
    assert store.transition(job, JobState.RUNNING, expect=[JobState.STARTING])


def freeze_mid_run(proc: subprocess.Popen, redis_url: str, job: str, after: int) -> None:
    """SIGSTOP to the driver's whole group once the job's stream holds epoch ``after``: the host is cut off."""
    wait(lambda: max(epochs(redis_url, job), default=0) >= after or proc.poll() is not None, "no epoch")
    assert proc.poll() is None, "the attempt ended before it could be frozen: make its epochs longer"
    os.killpg(proc.pid, signal.SIGSTOP)


def sums(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def kept(run_dir: Path) -> dict[str, int]:
    return {p.name: checkpoint_attempt(p) for p in run_dir.glob("checkpoint_*")}


@pytest.fixture()
def started() -> Iterator[list[subprocess.Popen]]:
    """The drivers a test started: none is left behind, frozen or running, whatever the test found."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_frozen_attempts_continued_during_and_after_the_live_one_land_nothing(
        redis_server: str, tmp_path: Path, started: list[subprocess.Popen]) -> None:
    store = Store.from_url(redis_server)
    job = store.submit("alice", ExperimentSubmit(spec=SPEC))[0]
    run_dir, logs = tmp_path / job, {n: tmp_path / f"attempt-{n}.log" for n in (1, 2, 3)}
    frozen: dict[int, subprocess.Popen] = {}
    checkpoints_at_freeze: dict[int, set[str]] = {}
    for attempt, after in ((1, 3), (2, 8)):  # each cut off mid-run; the service requeues the job
        start(store, job, attempt)
        frozen[attempt] = driver(redis_server, tmp_path, job, logs[attempt])
        started.append(frozen[attempt])
        freeze_mid_run(frozen[attempt], redis_server, job, after)
        checkpoints_at_freeze[attempt] = set(kept(run_dir))
        assert store.transition(job, JobState.QUEUED, expect=[JobState.RUNNING], reason="its node was lost")

    start(store, job, 3)
    live = driver(redis_server, tmp_path, job, logs[3])
    started.append(live)
    wait(lambda: max(epochs(redis_server, job), default=0) >= 12, "attempt 3 made no progress")
    os.killpg(frozen[1].pid, signal.SIGCONT)  # healed while attempt 3 trains
    assert frozen[1].wait(60) == ENDED_EXIT, logs[1].read_text()[-3000:]
    assert live.wait(120) == 0, logs[3].read_text()[-3000:]
    assert store.transition(job, JobState.SUCCEEDED, expect=[JobState.RUNNING])
    artifacts = sums(run_dir / "artifacts")
    summary, stream = store.r.hget(keys.job(job), "summary"), store.r.xlen(keys.events(job))
    assert json.loads(summary)["epochs"] == EPOCHS

    os.killpg(frozen[2].pid, signal.SIGCONT)  # healed after the job succeeded
    assert frozen[2].wait(60) == ENDED_EXIT, logs[2].read_text()[-3000:]
    assert sums(run_dir / "artifacts") == artifacts and set(artifacts) >= {"model.safetensors", "SHA256SUMS"}
    assert store.r.hget(keys.job(job), "summary") == summary and store.r.xlen(keys.events(job)) == stream
    assert epochs(redis_server, job) == list(range(EPOCHS))  # each epoch once, none after the last
    for name, attempt in kept(run_dir).items():  # an ended attempt kept only what it wrote while current
        assert attempt == 3 or name in checkpoints_at_freeze[attempt], (name, attempt)
    assert not [n for n in os.listdir(run_dir) if n.startswith(".")]  # nothing staged or half-written is left
    for attempt in (1, 2):
        assert "has ended" in logs[attempt].read_text()
