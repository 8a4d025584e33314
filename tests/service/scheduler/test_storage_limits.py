"""A running job's files are bounded: over ``TLAB_MAX_JOB_GB``, or taking its owner past ``quotas.max_storage_gb``
with what their ended jobs hold, the scheduler stops it and it ends failed saying which limit and both figures.

The scheduler runs on real Redis, ticked at chosen times, with Ray's Jobs API behind its Launcher seam (as in
test_fair_share.py); the files are real files in the storage directory (sparse: their size counts, as ``du`` would
not, so the test needs no disk)."""

from __future__ import annotations

import json
from pathlib import Path

from api_schemas import keys
from api_schemas.jobs import ExperimentSubmit, JobState, Quotas, UserCreate
from service.core import storage_lifecycle
from service.core.settings import Settings
from service.core.store import Store
from service.launch.ray_cluster import RayJobs, StaticCluster
from service.rules.limits import STORAGE_LIMITED
from service.scheduler.tick import Scheduler
from tests.service.conftest import tiny
from tests.service.scheduler.test_fair_share import NODES, Jobs, tick

MB = 1_000_000


def plant(storage: Path, job_id: str, size: int, where: str = "checkpoint_000001") -> None:
    """A file of ``size`` bytes in the job's storage, where its checkpoints or its own code would write."""
    path = storage / job_id / where / "blob.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.truncate(size)


def started(redis_server: str, tmp_path: Path, owner: str, **env: object) -> tuple[Store, Jobs, Scheduler, str]:
    """A scheduler over a fresh redis-server (the fixture's), one job of ``owner`` running since t = 1001."""
    store, ray = Store.from_url(redis_server), Jobs()
    settings = Settings(redis_url=redis_server, cluster_nodes=NODES, TLAB_STORAGE=str(tmp_path / "storage"),
                        TLAB_STORAGE_CHECK_S=30, **env)
    sched = Scheduler(store, settings, StaticCluster(NODES), ray)
    job = store.submit(owner, ExperimentSubmit.model_validate({"spec": tiny()}), now=999.0)[0]
    tick(sched, 1000.0)
    tick(sched, 1001.0)
    assert store.raw(job)["state"] == "running"
    return store, ray, sched, job


def test_a_job_whose_files_pass_the_cluster_limit_is_stopped_and_says_so(redis_server: str, tmp_path: Path) -> None:
    store, ray, sched, job = started(redis_server, tmp_path, "ann", TLAB_MAX_JOB_GB=0.005)  # 5 MB
    storage = tmp_path / "storage"
    plant(storage, job, 4 * MB)
    tick(sched, 1040.0)  # measured: 4 MB, within
    assert ray.states[RayJobs.submission_id(job, 1)] == "RUNNING" and not store.raw(job).get(STORAGE_LIMITED)
    plant(storage, job, 2 * MB, "artifacts")  # 6 MB now, but measured only every TLAB_STORAGE_CHECK_S
    tick(sched, 1050.0)
    assert ray.states[RayJobs.submission_id(job, 1)] == "RUNNING"
    tick(sched, 1071.0)  # measured again: over, stopped (SIGTERM: its driver exports its artifacts)
    assert ray.states[RayJobs.submission_id(job, 1)] == "STOPPED"
    tick(sched, 1072.0)
    view = store.view(job)
    assert view.state == JobState.FAILED and view.failure_reason == store.raw(job)[STORAGE_LIMITED]
    assert view.failure_reason.startswith("storage limit: its files hold 0.01 GB, over TLAB_MAX_JOB_GB=0.005: "), view


def test_a_job_that_takes_its_owner_past_their_quota_is_stopped_an_admins_is_not(redis_server: str,
                                                                                 tmp_path: Path) -> None:
    store, ray, sched, job = started(redis_server, tmp_path, "ann")
    store.create_user(UserCreate(name="ann", quotas=Quotas(max_storage_gb=0.01)))  # 10 MB
    store.r.hincrby(keys.storage_usage(), "ann", 7 * MB)  # what her ended jobs hold
    plant(tmp_path / "storage", job, 2 * MB)
    tick(sched, 1040.0)  # 7 + 2 MB: within
    assert ray.states[RayJobs.submission_id(job, 1)] == "RUNNING"
    plant(tmp_path / "storage", f"sweep-{job}", 2 * MB)  # a sweep's trials count too
    tick(sched, 1080.0)
    tick(sched, 1081.0)
    reason = store.view(job).failure_reason or ""
    assert reason.startswith("storage quota: its files hold 0.00 GB and your ended jobs 0.01 GB, over your "
                             "max_storage_gb quota of 0.01: stopped"), reason
    assert json.loads(store.raw(job)["spec"])["training"]  # the job itself is kept, only stopped

    admin = Store.from_url(redis_server)
    admin.create_user(UserCreate(name="boss", role="admin", quotas=Quotas(max_storage_gb=0.001)))
    boss = admin.submit("boss", ExperimentSubmit.model_validate({"spec": tiny()}), now=1100.0)[0]
    tick(sched, 1101.0)
    tick(sched, 1102.0)
    plant(tmp_path / "storage", boss, 3 * MB)  # over her quota, within TLAB_MAX_JOB_GB: admins are not bound
    tick(sched, 1140.0)
    assert admin.raw(boss)["state"] == "running" and not admin.raw(boss).get(STORAGE_LIMITED)


def test_a_job_that_writes_too_many_files_is_stopped_and_the_measure_reads_no_more(redis_server: str,
                                                                                   tmp_path: Path) -> None:
    store, ray, sched, job = started(redis_server, tmp_path, "ann", TLAB_MAX_JOB_FILES=40)
    many = tmp_path / "storage" / job / "shards"
    many.mkdir(parents=True)
    for i in range(30):
        (many / f"{i}.txt").write_text("x")
    tick(sched, 1040.0)  # 31 entries (the directory and its files): within
    assert ray.states[RayJobs.submission_id(job, 1)] == "RUNNING"
    for i in range(30, 60):
        (many / f"{i}.txt").write_text("x")
    tick(sched, 1071.0)
    assert ray.states[RayJobs.submission_id(job, 1)] == "STOPPED"
    tick(sched, 1072.0)
    reason = store.view(job).failure_reason or ""
    assert reason.startswith("file limit: its directory holds more than 40 files and directories, over "
                             "TLAB_MAX_JOB_FILES=40: stopped, its last checkpoint is kept"), reason
    settings = Settings(redis_url=redis_server, TLAB_STORAGE=str(tmp_path / "storage"))
    assert storage_lifecycle.job_usage(settings, job, 10) == (9, 11)  # read: the directory, 9 files, the 11th entry
    assert storage_lifecycle.job_usage(settings, job) == (60, 61)  # every file's byte, every entry
