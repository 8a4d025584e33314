"""Continue and fork with a bucket as storage: the API finds the parent's kept checkpoints in the bucket when its
own copy has none, and the child's driver, on a node that never saw the parent, starts from the parent's
checkpoint pulled from the bucket (the in-driver path on a real Redis and moto's S3 server: no Ray needed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis

from api_schemas import keys
from api_schemas.lineage import StartFrom
from service.core import checkpoints
from service.core.settings import Settings
from tests.workers.on_ray.test_driver import epochs_of, starts_of
from tests.workers.test_run_entrypoint import put_job
from workers import run
from workers.job.bucket import ENV
from workers.job.redis_sink import read_events

PARENT, CHILD = "18f3a2b4c5d-0000b0", "18f3a2b4c5d-0000b1"
PLAIN = {"enabled": False}


def test_a_child_on_another_node_starts_from_its_parents_checkpoint_in_the_bucket(
    redis_server: str, s3_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TLAB_KEEP_CHECKPOINTS", "2")
    monkeypatch.setenv(ENV, s3_uri)
    put_job(redis_server, PARENT, training={"epochs": 3, "batch_size": 32}, teleport=PLAIN)
    run.run_job(PARENT, redis_server, str(tmp_path / "node-a"))
    shutil.rmtree(tmp_path / "node-a")  # the parent's node is gone: only the bucket has its checkpoints

    kept = checkpoints.kept_epochs(Settings(TLAB_STORAGE=s3_uri, TLAB_STORAGE_CACHE=str(tmp_path / "api")), PARENT)
    assert sorted(kept) == [2, 3]  # TLAB_KEEP_CHECKPOINTS=2, read by the API from the bucket
    put_job(redis_server, CHILD, training={"epochs": 5, "batch_size": 32}, teleport=PLAIN)
    start = StartFrom(job=PARENT, epoch=3, checkpoint=kept[3])
    redis.Redis.from_url(redis_server).hset(keys.job(CHILD), "start_from", start.model_dump_json())
    run.run_job(CHILD, redis_server, str(tmp_path / "node-b"))
    events = read_events(redis_server, CHILD)
    assert epochs_of(events) == [3, 4] and starts_of(events) == [3]  # from the parent's epoch 3, each once
