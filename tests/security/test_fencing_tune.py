"""Fencing of a sweep's Tune storage: with a bucket, Tune writes its state, its trials' results and checkpoints
through the bucket's pyarrow filesystem, from the sweep's driver and from its trials' actors on any host. An ended
attempt's Tune (a host cut off and healed after the sweep moved on) writes nothing there: every write through the
filesystem ``TuneStorage`` hands Tune, and through the copy Tune pickles to a trial's actor, is refused once the
job's record moved past the attempt, before and after the job succeeded; reads go on. Real Redis, moto's S3 server."""

from __future__ import annotations

import pickle
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from api_schemas.jobs import JobState
from service.core.store import Store
from tests.s3 import s3_endpoint, s3_uri  # noqa: F401 - fixtures
from tests.security.test_fencing import as_attempt, requeue, start, submitted
from workers.job.bucket import ENV
from workers.job.fence import AttemptEnded
from workers.on_ray.tune_storage import tune_storage


def write(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as out:
        out.write(data)


def read(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def writes(fs: pafs.FileSystem, root: str) -> list[tuple[str, object]]:
    """Every kind of write Tune makes (a file, a directory, a delete, a move, a copy), each a thunk."""
    return [("open_output_stream", lambda: write(fs, f"{root}/experiment_state.json", b"stale")),
            ("create_dir", lambda: fs.create_dir(f"{root}/trial_x/checkpoint_000009")),
            ("delete_file", lambda: fs.delete_file(f"{root}/trial_a/result.json")),
            ("delete_dir", lambda: fs.delete_dir(f"{root}/trial_a")),
            ("delete_dir_contents", lambda: fs.delete_dir_contents(f"{root}/trial_a")),
            ("move", lambda: fs.move(f"{root}/trial_a/result.json", f"{root}/trial_a/moved.json")),
            ("copy_file", lambda: fs.copy_file(f"{root}/trial_a/result.json", f"{root}/trial_a/copy.json"))]


def listing(fs: pafs.FileSystem, root: str) -> dict[str, bytes]:
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    return {i.path: read(fs, i.path) for i in infos if i.type == pafs.FileType.File}


def test_an_ended_attempts_tune_writes_nothing_to_the_bucket_from_the_driver_or_a_trials_actor(
        redis_server: str, s3_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv(ENV, s3_uri)
    store = Store.from_url(redis_server)
    job = submitted(store)
    name = f"sweep-{job}"
    url = start(store, job, 1, redis_server)
    with as_attempt(job, 1, url):
        old = tune_storage(str(tmp_path / "host-a"), job, name)
        old_fs, root = old.fs, old.at(name)
        assert old_fs.type_name.startswith("py::fenced+")  # what Tune gets: the fenced filesystem
        write(old_fs, f"{root}/trial_a/result.json", b"epoch 1")  # the live attempt writes as Tune does
        in_actor = pickle.loads(pickle.dumps(old_fs))  # as Tune sends it to a trial's actor on another host
        write(in_actor, f"{root}/trial_a/params.json", b"{}")
    requeue(store, job)
    start(store, job, 2, redis_server)
    with as_attempt(job, 2, url):
        live = tune_storage(str(tmp_path / "host-b"), job, name)
        write(live.fs, f"{root}/trial_a/result.json", b"epoch 1\nepoch 2")
        write(live.fs, f"{root}/experiment_state.json", b"live")
    kept = listing(live.fs, root)

    for ended in ("requeued", "succeeded"):
        if ended == "succeeded":
            assert store.transition(job, JobState.SUCCEEDED, expect=[JobState.RUNNING])
        for fs in (old_fs, in_actor):
            for what, thunk in writes(fs, root):
                with pytest.raises(AttemptEnded, match="attempt 1"):
                    thunk()  # type: ignore[operator]
                assert listing(live.fs, root) == kept, (ended, what)
            assert read(fs, f"{root}/experiment_state.json") == b"live"  # reads go on
        with as_attempt(job, 1, url):
            (tmp_path / "host-a" / name).mkdir(parents=True, exist_ok=True)
            (tmp_path / "host-a" / name / "experiment_state.json").write_bytes(b"stale rerun state")
            old.send_back(name)  # a rerun's rewritten state: not sent by an ended attempt
        assert listing(live.fs, root) == kept, ended


def test_outside_the_service_tune_gets_the_bucket_as_it_is(s3_uri: str, tmp_path: Path,  # noqa: F811
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, s3_uri)
    shared = tune_storage(str(tmp_path), "local-run", "sweep-local-run")  # no attempt pinned: tlab run --ray
    assert not shared.fs.type_name.startswith("py::")
