"""Red team: a gang's start checkpoint is decided once, by its driver, and every rank starts from that decision.

The driver (``workers.run.run_job``) first pulls the run's newest checkpoint from the bucket, then decides where
the job starts (a continued job whose run has a checkpoint of its own goes on from it, not from its parent), and only
then starts the gang's other ranks (``workers.on_ray.gang_start.Ranks``) with that decision as their task argument,
rank 0's payload too; the in-process gang (``workers.on_ray.gang.lead``) hands its ranks the checkpoint it was given.
Nothing reads ``start_from`` from the job's keys behind the driver's back. Real Redis and files; Ray's task calls
recorded in place of a cluster (no Ray runs here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from api_schemas import ExperimentSpec, keys
from api_schemas.lineage import StartFrom
from tests.service.conftest import tiny

GANG, PARENT = "18f3a2b4c5d-000020", "18f3a2b4c5d-000021"
CKPT = "checkpoint_2026-01-01_00-00-00.000000"
OWN = "checkpoint_2026-02-01_00-00-00.000000"
SPEC = ExperimentSpec.model_validate(tiny(resources={"workers": 2}))


class Stop(Exception):
    """Where the test ends the gang's try (no rank joins)."""


@pytest.fixture()
def rank_tasks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Each rank task's arguments, as ``Ranks`` hands them to Ray (the last: the start checkpoint)."""
    import ray

    started: list[tuple[Any, ...]] = []

    class Task:
        def options(self, **_: Any) -> Task:
            return self

        def remote(self, *args: Any) -> object:
            started.append(args)
            return object()

    def wait(*_: Any, **__: Any) -> Any:
        raise Stop("no rank joins here")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(ray, "remote", lambda _fn: Task())
    monkeypatch.setattr(ray, "wait", wait)
    return started


def storage_of(tmp_path: Path) -> Path:
    storage = tmp_path / "storage"
    (storage / PARENT / CKPT).mkdir(parents=True)
    (storage / PARENT / CKPT / "checkpoint.pt").write_bytes(b"the parent's weights")
    return storage


def test_the_driver_decides_after_the_pull_and_hands_the_ranks_that(
        redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank_tasks: list[tuple[Any, ...]]) -> None:
    from workers import run
    from workers.on_ray import supervisor
    from workers.train.failure import JobFailed

    storage = storage_of(tmp_path)
    client = redis.Redis.from_url(redis_server, decode_responses=True)
    client.hset(keys.job(GANG), mapping={"spec": SPEC.model_dump_json(),
                                         "start_from": StartFrom(job=PARENT, epoch=1, checkpoint=CKPT)
                                         .model_dump_json()})

    def pulled(storage_: str, job_id: str) -> str:  # the bucket held the run's own newer checkpoint: now here too
        (Path(storage_) / job_id / OWN).mkdir(parents=True)
        (Path(storage_) / job_id / OWN / "checkpoint.pt").write_bytes(b"the run's own weights")
        return OWN

    rank0: list[Any] = []

    def supervise(spec: Any, job_id: str, redis_url: str, storage_: str, max_failures: int, out: Path,
                  start: Path | None, placement: list[str], ranks: Any) -> dict[str, Any]:
        rank0.append((start, ranks.start_from))
        return {"failed": True, "reason": "stopped by the test"}

    monkeypatch.setenv("TLAB_IN_DRIVER", "1")
    monkeypatch.setattr(run, "pull_checkpoint", pulled)
    monkeypatch.setattr(supervisor, "supervise", supervise)
    with pytest.raises(JobFailed, match="stopped by the test"):
        run.run_job(GANG, redis_server, str(storage), max_failures=0)
    assert [args[-1] for args in rank_tasks] == [None]  # rank 1: the run's own checkpoint, not its parent's
    assert rank0 == [(None, None)]  # rank 0: the same decision
    client.close()


def test_a_gang_led_in_process_hands_its_ranks_the_start_it_was_given(
        redis_server: str, tmp_path: Path, rank_tasks: list[tuple[Any, ...]]) -> None:
    import torch

    from workers.on_ray.gang import lead

    storage = storage_of(tmp_path)  # the job's keys name no start: only the caller's decision does
    with pytest.raises(Stop):
        lead(SPEC, GANG, redis_server, storage, sink=None, device=torch.device("cpu"),  # type: ignore[arg-type]
             start_from=storage / PARENT / CKPT)
    assert [args[-1] for args in rank_tasks] == [str(storage / PARENT / CKPT)]
