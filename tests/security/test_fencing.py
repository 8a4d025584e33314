"""Fencing: an attempt of a job that the service has moved past (requeued after its host was cut off, restarted
elsewhere, the job succeeded since) lands nothing: no event, no summary, no checkpoint, no export, no upload.

Driven with the real functions the job's processes call (the sink, the record, ``DriverContext``'s checkpoint writer,
the export and its promotion, the bucket push) as the old attempt, after the job's record moved on, on a real Redis
and moto's S3 server; the service's view (what ``tlab pull`` downloads, synced from the bucket) is checked by sha256.
The stale attempt run as a real process, stopped and continued: ``test_fencing_stale_job.py``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import torch

from api_schemas import build_spec, keys
from api_schemas.jobs import ExperimentSubmit, JobState
from service.core import storage
from service.core.settings import Settings
from service.core.store import Store
from service.launch.job_acl import JobAcl
from tests.conftest import _free_port, start_redis
from tests.s3 import s3_endpoint, s3_uri  # noqa: F401 - fixtures
from tests.service.conftest import tiny
from workers.job import fence
from workers.job.artifacts import export, promote, staging_dir
from workers.job.bucket import ENV, bucket, pull_checkpoint, push, wait_uploads
from workers.job.fence import AttemptEnded, Fence, Keepalive, clear_staged
from workers.job.record import write_summary
from workers.job.redis_sink import RedisSink, read_events
from workers.job.ticket import redeem
from workers.on_ray.driver import DriverContext
from workers.train.sinks import NullSink

SPEC = build_spec(tiny())


def submitted(store: Store) -> str:
    return store.submit("alice", ExperimentSubmit(spec=SPEC))[0]


def start(store: Store, job: str, attempt: int, service_url: str, acl: JobAcl | None = None) -> str:
    """The scheduler's start of ``attempt``: the record moved to it (running); the job's own Redis URL (its ACL user's
    with ``acl``, else the service's)."""
    sid = f"tlab-{job}-{attempt}"
    assert store.transition(job, JobState.STARTING, expect=[JobState.QUEUED], ray_job_id=sid, attempts=str(attempt))
    url = redeem(acl.credentials(job, sid)[keys.JOB_TICKET_ENV]) if acl else service_url
    assert store.transition(job, JobState.RUNNING, expect=[JobState.STARTING])
    return url


def requeue(store: Store, job: str) -> None:
    """The service gave the attempt up (its host was lost) and queued the job again."""
    assert store.transition(job, JobState.QUEUED, expect=[JobState.RUNNING], reason="a node of its gang was lost")


@contextmanager
def as_attempt(job: str, attempt: int, url: str) -> Iterator[None]:
    """This process acts as ``attempt`` of ``job`` (what its harness pins at start)."""
    fence.pin(job, attempt, url)
    try:
        yield
    finally:
        fence.unpin(job)


def epoch(n: int) -> dict:
    return {"kind": "epoch", "epoch": n, "train_loss": 1.0 / n, "test_loss": 1.0 / n, "seconds": 0.1}


def state(n: int, value: float) -> dict:
    """A training state after epoch ``n`` whose weights are all ``value``."""
    return {"model": {"w": torch.full((8,), float(value))}, "epoch": n, "history": [epoch(k) for k in range(1, n + 1)]}


def sums(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("isolated", [True, False], ids=["job-redis-user", "service-redis-url"])
def test_an_ended_attempts_records_are_refused_after_a_requeue_and_after_success(redis_server: str,
                                                                                 isolated: bool) -> None:
    """Attempt 1 keeps its connection (its ACL user is made again, not deleted, when attempt 2 starts before a tick
    syncs the users); its events and summary are refused once the job was requeued, once attempt 2 started, and
    once the job succeeded; attempt 2's land."""
    store = Store.from_url(redis_server)
    acl = JobAcl(store.r, Settings(redis_url=redis_server)) if isolated else None
    job = submitted(store)
    old_url = start(store, job, 1, redis_server, acl)
    old = RedisSink(old_url, job, attempt=1)
    old.emit(epoch(1))
    requeue(store, job)
    with pytest.raises(AttemptEnded, match="the job is queued"):
        old.emit(epoch(2))
    url = start(store, job, 2, redis_server, acl)
    live = RedisSink(url, job, attempt=2)
    live.emit(epoch(2))
    with pytest.raises(AttemptEnded, match="on attempt 2"):
        old.emit(epoch(3))
    with as_attempt(job, 1, old_url), pytest.raises(AttemptEnded):
        write_summary(old.client, job, json.dumps({"epochs": 3}))
    with as_attempt(job, 2, url):
        write_summary(live.client, job, json.dumps({"epochs": 2}))
    live.emit(epoch(3))
    assert store.transition(job, JobState.SUCCEEDED, expect=[JobState.RUNNING])
    with pytest.raises(AttemptEnded):
        old.emit(epoch(4))
    with as_attempt(job, 1, old_url), pytest.raises(AttemptEnded):
        write_summary(old.client, job, json.dumps({"epochs": 4}))
    with pytest.raises(AttemptEnded, match="the job is succeeded"):  # its own attempt, too, once the job ended
        live.emit(epoch(4))
    metrics = [e["data"]["epoch"] for e in read_events(redis_server, job) if e["kind"] == "metric"]
    assert metrics == [1, 2, 3]
    record = keys.job_run(job) if isolated else keys.job(job)
    assert json.loads(store.r.hget(record, "summary")) == {"epochs": 2}
    for sink in (old, live):
        sink.buffer.clear()
        sink.close()


def cut_writer(run_dir: Path, job: str, url: str, attempt: int, **kw: object) -> DriverContext:
    """Rank 0's checkpoint writer of ``attempt``, as its payload makes it (the check: its supervisor's)."""
    check = Fence(redis.Redis.from_url(url), job, attempt).check
    return DriverContext(NullSink(), run_dir, attempt=attempt, fence=kw.pop("fence", check), keep=2, **kw)


def test_a_cut_off_attempt_lands_no_checkpoint_export_or_upload_and_pull_serves_the_live_one(
        redis_server: str, s3_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Host A runs attempt 1 and is cut off after epoch 2 (uploaded); the service requeues the job, host B's attempt 2
    goes on from the bucket and exports epoch 4. Healed, A saves epoch 3, exports and pushes: before and after the
    job succeeded, nothing of it lands (its checkpoint, its staged export, the bucket untouched), and the files the
    API syncs for ``tlab pull`` are B's, sha256 for sha256."""
    monkeypatch.setenv(ENV, s3_uri)
    store = Store.from_url(redis_server)
    job = submitted(store)
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    url = start(store, job, 1, redis_server)
    with as_attempt(job, 1, url):
        a = cut_writer(host_a / job, job, url, 1)
        for n in (1, 2):
            a.save(state(n, n), {})
        a.flush()
        wait_uploads()  # (its writer's background pushes)
        push(host_a, job, prune=True, final=True)
    requeue(store, job)
    start(store, job, 2, redis_server)
    with as_attempt(job, 2, url):
        assert pull_checkpoint(host_b, job)
        b = cut_writer(host_b / job, job, url, 2)
        assert b.restore()["epoch"] == 2
        for n in (3, 4):
            b.save(state(n, 40 + n), {})
        b.flush()
        wait_uploads()
        out_b = host_b / job / "artifacts"
        export(SPEC, [host_b / job], staging_dir(out_b, 2), attempt=2)
        assert promote(staging_dir(out_b, 2), out_b, b.fence)
        push(host_b, job, prune=True, final=True)
    live, remote = sums(out_b), bucket().ls(job)

    for ended in ("requeued", "succeeded"):
        if ended == "succeeded":
            assert store.transition(job, JobState.SUCCEEDED, expect=[JobState.RUNNING])
        with as_attempt(job, 1, url):
            kept = sorted(p.name for p in (host_a / job).glob("checkpoint_*"))
            a.save(state(3, 99), {})
            with pytest.raises(AttemptEnded):
                a.flush()
            assert sorted(p.name for p in (host_a / job).glob("checkpoint_*")) == kept
            out_a = host_a / job / "artifacts"
            assert export(SPEC, [host_a / job], staging_dir(out_a, 1), attempt=1)
            with pytest.raises(AttemptEnded):
                promote(staging_dir(out_a, 1), out_a, a.fence)
            assert not out_a.exists() and not staging_dir(out_a, 1).exists()
            out_a.mkdir()
            (out_a / "model.safetensors").write_bytes(b"stale")  # what an older release exported unchecked
            push(host_a, job, prune=True, final=True)
            assert bucket().ls(job) == remote, ended
            (out_a / "model.safetensors").unlink()
            out_a.rmdir()

    api = Settings(redis_url=redis_server, storage=s3_uri, storage_cache=str(tmp_path / "api-cache"))
    storage.sync_artifacts(api, job)
    pulled = Path(api.storage_path) / job / "artifacts"
    assert sums(pulled) == live and set(live) >= {"model.safetensors", "checkpoint.pt", "SHA256SUMS"}
    from safetensors.torch import load_file

    assert load_file(str(pulled / "model.safetensors"))["w"].tolist() == [44.0] * 8  # B's epoch 4


def test_a_check_passed_just_before_the_record_moved_renames_nothing_on_a_shared_filesystem(
        redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 1 freezes right after a check passed, twice: its next checkpoint written to a hidden name, and its
    export staged and about to be promoted. The record moves and attempt 2 starts on the same directory; continued,
    attempt 1's renames find nothing: attempt 2's start removed what earlier attempts had staged."""
    monkeypatch.setenv("TLAB_CHECKPOINT_EVERY_S", "0")  # each save written at once
    store = Store.from_url(redis_server)
    job = submitted(store)
    run_dir, out = tmp_path / job, tmp_path / job / "artifacts"
    url = start(store, job, 1, redis_server)
    base = Fence(redis.Redis.from_url(url), job, 1).check
    frozen, go_on, freezing = threading.Semaphore(0), threading.Event(), threading.Event()

    def freezing_check() -> None:  # passes; then, once ``freezing`` is set, the host freezes
        base()
        if freezing.is_set():
            frozen.release()
            assert go_on.wait(30)

    with as_attempt(job, 1, url):
        a = cut_writer(run_dir, job, url, 1, fence=freezing_check)
        a.save(state(1, 1), {})
        a.flush()
        freezing.set()
        a.save(state(2, 2), {})  # its writer thread: staged, checked, frozen before the rename
        assert export(SPEC, [run_dir], staging_dir(out, 1), attempt=1)
        promoting = threading.Thread(target=promote, args=(staging_dir(out, 1), out, freezing_check))
        promoting.start()
        assert frozen.acquire(timeout=30) and frozen.acquire(timeout=30)
    requeue(store, job)
    start(store, job, 2, redis_server)
    with as_attempt(job, 2, url):
        clear_staged(run_dir, 2)  # attempt 2's supervisor at its start
        b = cut_writer(run_dir, job, url, 2)  # its rank 0's writer: drops half-written checkpoints
        assert b.restore()["epoch"] == 1
        b.save(state(2, 7), {})
        b.flush()
    ours = sorted(p.name for p in run_dir.glob("checkpoint_*"))
    go_on.set()
    promoting.join(30)
    with as_attempt(job, 1, url), pytest.raises(OSError):
        a.flush()  # its rename finds its staged checkpoint gone
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == ours and len(ours) == 2
    assert not out.exists() or not os.listdir(out)  # nothing of attempt 1's export was promoted
    assert not any(n.startswith(".") for n in os.listdir(run_dir))


def test_an_attempt_that_loses_redis_ends_itself_after_its_lease(tmp_path: Path) -> None:
    """The supervisor's keepalive: quiet while the attempt is current; Redis gone (the host cut off from the serving
    one) for the lease, it ends the attempt, saying why."""
    port = _free_port()
    server = start_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    store = Store.from_url(url)
    job = submitted(store)
    start(store, job, 1, url)
    ended = threading.Event()
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    keepalive = Keepalive(Fence(client, job, 1), lambda why: ended.set(), lease=1.0, every_s=0.1).start()
    assert not ended.wait(0.5)
    cut = time.monotonic()
    server.kill()
    server.wait()
    assert ended.wait(10)
    assert 0.8 <= time.monotonic() - cut < 5 and "lost Redis for 1 s" in keepalive.ended


def test_a_payload_dies_with_its_supervisor() -> None:
    """A supervisor ended with its Ray worker (its node lost) takes its payload along: nothing of it runs on."""
    import psutil

    code = ("import subprocess, time; from workers.on_ray.supervisor import die_with_parent; "
            "p = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent); print(p.pid, flush=True); "
            "time.sleep(60)")
    supervisor = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert supervisor.stdout is not None
    payload = psutil.Process(int(supervisor.stdout.readline()))
    supervisor.kill()
    supervisor.wait()
    supervisor.stdout.close()
    deadline = time.monotonic() + 10
    while payload.is_running() and payload.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the payload outlived its supervisor"
        time.sleep(0.05)
