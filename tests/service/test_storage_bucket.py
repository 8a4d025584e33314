"""Storage on an S3-compatible bucket, end to end: the real API, scheduler, Redis and Ray head
with ``TLAB_STORAGE=s3://...`` (moto's S3 server, tests/s3.py). A job's checkpoints, artifacts and logs reach the
bucket; with its local working copy deleted the API still lists and serves them; a preempted job whose local copy
is gone resumes from the bucket's checkpoint with every epoch exactly once."""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import pytest
import redis

from objstore import Bucket
from service.cli.client import Client
from service.stack.embedded import Stack
from tests.s3 import s3_endpoint, s3_uri  # noqa: F401 - fixtures
from tests.service.conftest import tiny, wait_ray_idle
from tests.service.scheduler.test_preemption import BOTH_CPUS, events
from tests.service.scheduler.test_time_limits import wait_epochs
from tests.service.test_failure_reasons import wait_ended

pytestmark = pytest.mark.slow


@pytest.fixture()
def stack_env(tmp_path: Path, s3_uri: str) -> dict[str, str]:  # noqa: F811
    """The ``stack`` fixture's API and scheduler with a bucket as TLAB_STORAGE, a working copy under tmp_path."""
    return {"TLAB_STORAGE": s3_uri, "TLAB_STORAGE_CACHE": str(tmp_path / "cache")}


def drop_local_copy(stack: Stack, job: str) -> None:
    """Delete the job's local working copy (as a node that never saw it, or a wiped disk)."""
    local = Path(stack.extra_env["TLAB_STORAGE_CACHE"]) / job
    while local.exists():  # a process may still be closing its log in it
        shutil.rmtree(local, ignore_errors=True)
        time.sleep(0.1)


def checkpoints_in(b: Bucket, job: str) -> set[str]:
    return {n.split("/")[0] for n in b.ls(job) if n.startswith("checkpoint_") and n.endswith("/checkpoint.pt")}


def test_a_jobs_files_live_in_the_bucket_and_are_served_from_it(stack: Stack) -> None:
    b = Bucket(stack.extra_env["TLAB_STORAGE"])
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(tiny(training={"epochs": 3}))["id"]
        assert wait_ended(c, job, timeout=300)["state"] == "succeeded"
        wait_ray_idle(stack)  # its driver is gone: its last log lines were pushed
        names = set(b.ls(job))
        for want in ("artifacts/model.safetensors", "artifacts/checkpoint.pt", "artifacts/metrics.csv",
                     "artifacts/summary.json", "logs/attempt-1/driver.log"):
            assert want in names, sorted(names)
        # the run keeps TLAB_KEEP_CHECKPOINTS=2 while it trains; once it ended, the scheduler keeps its newest only
        # (TLAB_KEEP_ENDED_CHECKPOINTS=1, service.core.storage_lifecycle), in the bucket too
        deadline = time.monotonic() + 30
        while len(kept := checkpoints_in(b, job)) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(kept) == 1, sorted(b.ls(job))
        drop_local_copy(stack, job)

        items = {a["name"]: a for a in c.json("GET", f"/v1/experiments/{job}/artifacts")["items"]}
        assert {"model.safetensors", "checkpoint.pt", "metrics.csv", "summary.json"} <= set(items), items
        with b.open(f"{job}/artifacts/model.safetensors") as f:
            weights = f.read()
        r = c.request("GET", f"/v1/experiments/{job}/artifacts/model.safetensors")
        assert r.content == weights and hashlib.sha256(weights).hexdigest() == items["model.safetensors"]["sha256"]
        r = c.request("GET", f"/v1/experiments/{job}/artifacts/metrics.csv", headers={"Range": "bytes=0-5"})
        assert r.status_code == 206 and r.content == b"epoch,"
        log = c.logs(job)
        assert log.startswith("[tlab] driver of job") and "model.safetensors" in log


@pytest.mark.drill
def test_a_preempted_job_resumes_from_the_bucket_on_a_node_that_lost_its_copy(stack: Stack) -> None:
    wait_ray_idle(stack)
    r = redis.Redis.from_url(stack.redis_url or "", decode_responses=True)
    epochs = 24  # preempted near epoch 7 (2 cores, alone)
    with Client(stack.url, stack.admin_token) as c:
        a = c.submit(tiny(training={"epochs": epochs, "batch_size": 32}, resources=BOTH_CPUS), name="long")["id"]
        wait_epochs(c, a, 2)
        b = c.submit(tiny(resources=BOTH_CPUS), name="urgent", priority=5)["id"]
        deadline = time.monotonic() + 120
        while c.get(a)["state"] != "queued":  # preempted: checkpointed, stopped, back in the queue
            assert time.monotonic() < deadline, c.get(a)
            time.sleep(0.2)
        drop_local_copy(stack, a)
        assert wait_ended(c, b, timeout=300)["state"] == "succeeded"
        view = wait_ended(c, a, timeout=300)
        assert view["state"] == "succeeded" and view["preemptions"] == 1, view
        assert [m["epoch"] for m in events(r, a, "epoch")] == list(range(epochs))  # every epoch exactly once
        starts = events(r, a, "start")
        assert len(starts) == 2 and starts[1]["resumed_from_epoch"] >= 2, starts
        second = c.logs(a, attempt=2)
        assert "[tlab] resuming from checkpoint_" in second and "pulled from s3://" in second, second
