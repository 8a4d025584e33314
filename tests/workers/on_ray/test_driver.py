"""A 1-worker job trained in its Ray job's driver (``workers.on_ray.driver``): checkpoints, retries, exactly-once
epochs and artifacts, on a real Redis (the driver path needs no Ray)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from api_schemas import keys
from tests.workers.test_run_entrypoint import put_job
from workers.job import harness
from workers.job.artifacts import PARTIAL_PREFIX, checkpoints, partial_prefix, remove_own_partials
from workers.job.redis_sink import read_events
from workers.on_ray.driver import DriverContext
from workers.train.failure import JobFailed
from workers.train.sinks import MemorySink


def in_process(job: str, redis_url: str, storage: str, max_failures: int) -> dict[str, Any]:
    """The driver's retry loop in this process (``run_in_driver``), with the artifacts and the summary as a job's
    run exports them: a job's payload runs this loop in its sandbox, a process the monkeypatched ``save`` of these
    tests cannot reach (the supervisor's own retries of a killed payload: ``test_run_entrypoint``)."""
    from workers.job.artifacts import artifacts_dir
    from workers.job.record import write_summary
    from workers.on_ray.tries import run_in_driver

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    spec, out = harness.load_job_spec(client, job), artifacts_dir(storage, job)
    try:
        summary = run_in_driver(spec, job, redis_url, storage, max_failures, out)
    finally:
        harness.export_artifacts(spec, [Path(storage) / job], out)
    if summary.get("failed"):
        raise JobFailed(str(summary.get("reason", "training failed")))
    write_summary(client, job, json.dumps(summary))
    return summary


def epochs_of(events: list[dict[str, Any]]) -> list[int]:
    return [e["data"]["epoch"] for e in events if e["kind"] == "metric"]


def starts_of(events: list[dict[str, Any]]) -> list[int]:
    return [e["data"]["resumed_from_epoch"] for e in events if e["data"].get("kind") == "start"]


def test_checkpoints_are_whole_newest_first_and_only_the_last_n_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TLAB_KEEP_CHECKPOINTS", "2")
    monkeypatch.setenv("TLAB_CHECKPOINT_EVERY_S", "0")  # every epoch's checkpoint written
    run_dir = tmp_path / "job"
    half = run_dir / f"{PARTIAL_PREFIX}killed"  # what a kill during a save leaves behind
    half.mkdir(parents=True)
    (half / "checkpoint.pt").write_bytes(b"half a file")
    ctx = DriverContext(MemorySink(), run_dir)
    assert not half.exists() and ctx.restore() is None
    for epoch in range(1, 5):
        ctx.save({"epoch": epoch, "w": torch.full((2,), float(epoch))}, {"epochs": epoch})
    ctx.flush()  # saves are written in the background: flush is when they are all on disk
    kept = checkpoints([run_dir])  # what workers.job.artifacts exports from
    assert len(kept) == 2 == len(list(run_dir.iterdir()))
    assert [json.loads((p / "meta.json").read_text())["epoch"] for p in kept] == [4, 3]
    ctx.save({"epoch": 5, "model": {"w": torch.full((2,), 5.0)}}, {"epochs": 5})
    ctx.save({"failed": "diverged at epoch 5"}, {"failed": True})  # what a diverged run's driver saves last
    ctx.flush()
    state = DriverContext(MemorySink(), run_dir).restore()
    assert state is not None and state["epoch"] == 5 and torch.equal(state["model"]["w"], torch.full((2,), 5.0))


def test_an_ended_attempts_supervisor_removes_only_the_half_written_checkpoints_of_its_own_attempt(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    ctx = DriverContext(MemorySink(), run_dir, attempt=2)
    ctx.save({"epoch": 1, "w": torch.ones(2)}, {"epochs": 1})
    ctx.flush()
    halves = {a: run_dir / f"{partial_prefix(a)}x" for a in (1, 2, 3)}  # three attempts, each killed mid-write
    for half in halves.values():
        half.mkdir()
        (half / "checkpoint.pt").write_bytes(b"half")
    (halves[2] / "link").symlink_to(tmp_path / "elsewhere")  # a link in it is removed, never followed
    (tmp_path / "elsewhere").mkdir()
    remove_own_partials(run_dir, 2)
    assert not halves[2].exists() and halves[1].exists() and halves[3].exists()
    assert (tmp_path / "elsewhere").is_dir() and len(checkpoints([run_dir])) == 1


def test_a_checkpoint_written_in_the_background_holds_the_state_as_it_was_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the loop goes on changing the weights in place while the writer thread works: what is written is the
    # state at save time, whole, in save order; a write's error reaches the loop at the next save or flush
    monkeypatch.setenv("TLAB_CHECKPOINT_EVERY_S", "0")
    ctx = DriverContext(MemorySink(), tmp_path / "job", keep=10)
    w = torch.zeros(1000)
    state = {"epoch": 1, "model": {"w": w}, "history": [{"epoch": 0}]}
    for epoch in range(1, 4):
        state["epoch"] = epoch
        ctx.save(state, {"epochs": epoch})
        w.add_(1.0)  # what the optimizer does right after
        state["history"].append({"epoch": epoch})
    ctx.flush()
    saved = [json.loads((p / "meta.json").read_text())["epoch"] for p in checkpoints([tmp_path / "job"])]
    assert saved == [3, 2, 1]
    newest = DriverContext(MemorySink(), tmp_path / "job").restore()
    assert newest is not None and torch.equal(newest["model"]["w"], torch.full((1000,), 2.0))
    assert len(newest["history"]) == 3  # the list as it was at the third save
    ctx.run_dir = tmp_path / "gone"  # a directory that does not exist: the write fails in the background
    ctx.save(state, {"epochs": 4})
    with pytest.raises(FileNotFoundError):
        ctx.flush()


def test_within_the_interval_the_last_states_are_held_and_written_by_a_flush_or_before_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TLAB_CHECKPOINT_EVERY_S", "3600")
    run_dir = tmp_path / "job"
    ctx = DriverContext(MemorySink(), run_dir, keep=2)

    def on_disk() -> list[int | None]:
        return [json.loads((p / "meta.json").read_text())["epoch"] for p in checkpoints([run_dir])]

    w = torch.zeros(10)
    for epoch in range(1, 6):
        ctx.save({"epoch": epoch, "model": {"w": w}}, {"epochs": epoch})
        w.add_(1.0)  # the next epoch changes the weights in place: what is held is a copy
    assert ctx._writer is not None
    ctx._writer.flush()  # the writes submitted so far (not the held copies) are on disk
    assert on_disk() == [1]  # the first epoch is written at once, the later ones within the hour are held
    ctx.flush()  # the run's end, a stop or a failure: the last `keep` epochs are written, in epoch order
    assert on_disk() == [5, 4]  # what an ended run kept before the interval existed: continue and fork name these
    newest = DriverContext(MemorySink(), run_dir).restore()
    assert newest is not None and torch.equal(newest["model"]["w"], torch.full((10,), 4.0))
    ctx.save({"epoch": 6, "model": {"w": w}}, {"epochs": 6})  # held
    ctx.save({"failed": "diverged at epoch 6"}, {"failed": True})  # written at once, after the held epoch 6
    ctx.flush()
    assert on_disk() == [None, 6]  # the failure's marker (no epoch), newest, after epoch 6
    state = DriverContext(MemorySink(), run_dir).restore()
    assert state is not None and state["epoch"] == 6


@pytest.mark.parametrize("raw", ["-1", "soon", "inf", "nan"])
def test_a_bad_checkpoint_interval_is_refused_by_name(raw: str, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    monkeypatch.setenv("TLAB_CHECKPOINT_EVERY_S", raw)
    with pytest.raises(ValueError, match="TLAB_CHECKPOINT_EVERY_S"):
        DriverContext(MemorySink(), tmp_path / "job")


def test_a_stop_while_waiting_for_a_write_leaves_it_to_the_next_flush() -> None:
    # SIGTERM raises Stopped in the main thread, possibly while it waits for the previous write: that write is
    # still pending, and the flush on the way out waits for it (review: it returned at once, with nothing written)
    import signal
    import threading

    from workers.on_ray.driver import CheckpointWriter

    class Stopped(Exception):
        pass

    def stop(signum: int, frame: object) -> None:
        raise Stopped

    done = threading.Event()
    writer = CheckpointWriter()
    writer.submit(lambda state: (time.sleep(0.5), done.set()), {})
    before = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Stopped):
            writer.flush()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert not done.is_set()
    writer.flush()
    assert done.is_set()


def test_a_failure_retries_from_the_last_checkpoint_and_reports_every_epoch_once(
    redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TLAB_KEEP_CHECKPOINTS", "3")
    put_job(redis_server, "flaky", training={"epochs": 5, "batch_size": 32})
    save, crashed = DriverContext.save, []

    def save_then_crash_once(self: DriverContext, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        save(self, state, metrics)
        if state["epoch"] == 3 and not crashed:  # epoch 2 is reported and checkpointed, then the process fails
            crashed.append(True)
            raise ConnectionError("lost the node's disk for a moment")

    monkeypatch.setattr(DriverContext, "save", save_then_crash_once)
    summary = in_process("flaky", redis_server, str(tmp_path), max_failures=1)
    events = read_events(redis_server, "flaky")
    assert epochs_of(events) == [0, 1, 2, 3, 4]  # the retry redid nothing it had reported
    assert starts_of(events) == [0, 3]  # it went on from its last checkpoint
    assert any("retry 1 of TLAB_MAX_FAILURES=1" in e["data"].get("message", "") for e in events)
    assert summary["epochs"] == 5 and "params" not in summary  # the last checkpoint's metrics, as Ray Train
    assert json.loads(redis.Redis.from_url(redis_server).hget(keys.job("flaky"), "summary")) == summary
    assert len(checkpoints([tmp_path / "flaky"])) == 3
    artifacts = tmp_path / "flaky" / "artifacts"
    exported = json.loads((artifacts / "summary.json").read_text())
    assert exported["complete"] and exported["epochs"] == 5 and (artifacts / "model.safetensors").is_file()
    assert (artifacts / "metrics.csv").read_text().count("\n") == 6
    # run again (the cluster went down after the last epoch, before the scheduler saw the job end): nothing left
    # to train, the same summary (but the peak memory of the process that wrote it, which may have grown since)
    again = in_process("flaky", redis_server, str(tmp_path), max_failures=1)
    assert again.pop("host_memory_peak_mb") >= summary.pop("host_memory_peak_mb") and again == summary
    assert starts_of(read_events(redis_server, "flaky")) == [0, 3, 5]


@pytest.mark.parametrize("error", [RuntimeError("flaky"), ValueError("teleport.lr: too large")])
def test_retries_stop_at_max_failures_and_a_deterministic_error_is_not_retried(
    redis_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    put_job(redis_server, "bad", training={"epochs": 3, "batch_size": 32})

    def fail(self: DriverContext, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        raise error

    monkeypatch.setattr(DriverContext, "save", fail)
    with pytest.raises(type(error)):
        in_process("bad", redis_server, str(tmp_path), max_failures=2)
    tries = 1 if isinstance(error, ValueError) else 3
    assert starts_of(read_events(redis_server, "bad")) == [0] * tries


def test_a_diverging_job_fails_once_with_its_reason_and_no_summary(redis_server: str, tmp_path: Path) -> None:
    put_job(redis_server, "nan", optimizer={"name": "sgd", "lr": 1e30}, teleport={"enabled": False})
    with pytest.raises(JobFailed, match="diverged at epoch 0"):
        in_process("nan", redis_server, str(tmp_path), max_failures=3)
    assert starts_of(read_events(redis_server, "nan")) == [0]
    assert redis.Redis.from_url(redis_server).hget(keys.job("nan"), "summary") is None
