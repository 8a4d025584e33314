"""Storage on a bucket (``objstore``, ``workers.job.bucket``, ``service.core.storage``) against a real S3 endpoint:
moto's server over HTTP (tests/s3.py, via conftest.py), spoken to by pyarrow's AWS client (MinIO or S3 on a cluster)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from objstore import Bucket, StorageError
from service.api import artifacts
from service.core import storage
from service.core.settings import Settings

JOB = "18f3a2b4c5d-9e1f2a"


def tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def test_push_sends_new_and_changed_files_and_pull_brings_them_back(s3_uri: str, tmp_path: Path) -> None:
    b = Bucket(s3_uri)
    b.check()
    src = tmp_path / "src"
    tree(src, {"a.txt": b"alpha", "sub/b.bin": bytes(range(256)) * 4000, ".half.tmp": b"x"})
    (src / "link.txt").symlink_to(src / "a.txt")
    assert b.push(src, "job") == ["a.txt", "sub/b.bin"]  # not the hidden file, not the symlink
    assert {k: v.size for k, v in b.ls("job").items()} == {"a.txt": 5, "sub/b.bin": 1_024_000}
    assert b.push(src, "job") == []  # nothing changed
    (src / "a.txt").write_bytes(b"alpha, longer")
    assert b.push(src, "job") == ["a.txt"]
    dst = tmp_path / "dst"
    assert b.pull("job", dst) == ["a.txt", "sub/b.bin"]
    assert (dst / "sub/b.bin").read_bytes() == (src / "sub/b.bin").read_bytes()
    assert b.pull("job", dst) == []  # up to date
    shutil.rmtree(dst / "sub")
    (dst / "sub").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert b.pull("job", dst) == []  # never written through a link out of the directory
    with b.open("job/a.txt") as f:
        assert f.read() == b"alpha, longer"


def test_a_file_removed_while_a_push_runs_is_left_out_and_the_rest_is_sent(s3_uri: str, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A run rotates its checkpoints while its background push runs: a folder listed, then removed before its
    upload, is nothing to send, not a failed push (which would hold the bucket's copy back for RETRY_S)."""
    b = Bucket(s3_uri)
    src = tmp_path / "src"
    tree(src, {"checkpoint_1/checkpoint.pt": b"old", "checkpoint_1/meta.json": b"{}",
               "checkpoint_2/checkpoint.pt": b"new", "checkpoint_2/meta.json": b"{}"})
    upload = Bucket.upload

    def rotating(self: Bucket, path: Path, rel: str) -> None:
        shutil.rmtree(src / "checkpoint_1", ignore_errors=True)  # the run's rotation, right after the listing
        upload(self, path, rel)

    monkeypatch.setattr(Bucket, "upload", rotating)
    assert b.push(src, "job") == ["checkpoint_2/checkpoint.pt", "checkpoint_2/meta.json"]
    assert sorted(b.ls("job")) == ["checkpoint_2/checkpoint.pt", "checkpoint_2/meta.json"]


def test_a_log_is_replaced_only_by_a_longer_copy(s3_uri: str, tmp_path: Path) -> None:
    b = Bucket(s3_uri)
    tree(tmp_path / "remote", {"driver.log": b"line 1\nline 2\n"})
    b.push(tmp_path / "remote", "logs")
    local = tmp_path / "local"
    tree(local, {"driver.log": b"line 1\nline 2\nline 3\n"})  # this machine is further on: kept
    assert b.pull("logs", local, grow_only=True) == []
    tree(local, {"driver.log": b"line 1\n"})
    assert b.pull("logs", local, grow_only=True) == ["driver.log"]
    assert (local / "driver.log").read_bytes() == b"line 1\nline 2\n"


@pytest.mark.parametrize("uri, said", [("s3:///lab", "Missing bucket"), ("s3://", "names no bucket"),
                                        ("nosuch://x/y", "Unrecognized"), ("s3://b/x?bogus=1", "bogus")])
def test_a_malformed_uri_is_one_line_naming_the_setting(uri: str, said: str) -> None:
    with pytest.raises(StorageError) as err:
        Bucket(uri)
    assert str(err.value).startswith(f"TLAB_STORAGE={uri!r}") and said in str(err.value)
    assert "\n" not in str(err.value)


def test_a_missing_or_unreachable_bucket_is_one_line(s3_endpoint: str) -> None:
    with pytest.raises(StorageError, match="bucket 'nosuch' does not exist"):
        Bucket(f"s3://nosuch/lab?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1").check()
    with pytest.raises(StorageError, match="cannot be reached"):
        Bucket("s3://b/lab?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1").check()


def test_a_plain_path_is_todays_storage(tmp_path: Path) -> None:
    s = Settings(TLAB_STORAGE=str(tmp_path / "st"), TLAB_STORAGE_CACHE=str(tmp_path / "cache"))
    assert (s.storage_path, s.storage_uri, storage.bucket(s)) == (str(tmp_path / "st"), "", None)
    storage.check(s)  # nothing to reach
    storage.sync_artifacts(s, JOB)  # nothing to pull


def test_workers_push_prunes_old_checkpoints_and_a_new_node_pulls_the_newest(s3_uri: str, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.job import bucket

    monkeypatch.setenv(bucket.ENV, s3_uri)
    node_a, node_b = tmp_path / "a", tmp_path / "b"
    old, new = "checkpoint_2026-01-01_00-00-00.000001", "checkpoint_2026-01-02_00-00-00.000001"
    tree(node_a / JOB, {f"{old}/checkpoint.pt": b"old", f"{old}/meta.json": b"{}",
                        "logs/attempt-1/driver.log": b"hi\n"})
    bucket.push(node_a, JOB)
    tree(node_a / JOB, {f"{new}/checkpoint.pt": b"new", f"{new}/meta.json": b"{}"})
    subprocess.run(["rm", "-r", str(node_a / JOB / old)], check=True)  # TLAB_KEEP_CHECKPOINTS dropped it
    bucket.push(node_a, JOB)
    assert any(old in n for n in Bucket(s3_uri).ls(JOB))  # only the run's writer prunes (another node has none)
    bucket.push(node_a, JOB, prune=True)
    names = set(Bucket(s3_uri).ls(JOB))
    assert {f"{new}/checkpoint.pt", "logs/attempt-1/driver.log"} <= names and not any(old in n for n in names)
    assert bucket.pull_checkpoint(node_b, JOB) == new
    assert (node_b / JOB / new / "checkpoint.pt").read_bytes() == b"new"
    assert bucket.pull_checkpoint(node_b, JOB) is None  # it has one now

    # node A's earlier copy is stale once node B went further: A pulls B's newest, and A's pruning push never
    # deletes what is newer than its own (review: a stale node resumed from its old checkpoint, then pruned)
    newer = "checkpoint_2026-01-03_00-00-00.000001"
    tree(node_b / JOB, {f"{newer}/checkpoint.pt": b"newer", f"{newer}/meta.json": b"{}"})
    bucket.push(node_b, JOB, prune=True)
    bucket.push(node_a, JOB, prune=True)  # A still holds only `new`
    assert any(newer in n for n in Bucket(s3_uri).ls(JOB))
    assert bucket.pull_checkpoint(node_a, JOB) == newer
    assert (node_a / JOB / newer / "checkpoint.pt").read_bytes() == b"newer"


def test_a_stale_copy_never_replaces_the_buckets_newer_one(s3_uri: str, tmp_path: Path) -> None:
    # an API host pulled a log while the job ran; a process on that host pushing the job's directory later must
    # not send that shorter, older copy over the whole log another host uploaded since
    b = Bucket(s3_uri)
    writer, reader = tmp_path / "writer", tmp_path / "reader"
    tree(writer, {"logs/driver.log": b"line 1\n"})
    b.push(writer, "job")
    b.pull("job", reader)
    os.utime(reader / "logs/driver.log", (1_000_000, 1_000_000))  # pulled long ago (its time: the bucket's then)
    tree(writer, {"logs/driver.log": b"line 1\nline 2\nline 3\n"})
    b.push(writer, "job")
    from objstore import _pushed

    _pushed.clear()  # another process on the reader's host: it never pushed that file
    assert b.push(reader, "job") == []
    with b.open("job/logs/driver.log") as f:
        assert f.read() == b"line 1\nline 2\nline 3\n"


def test_the_api_serves_artifacts_and_logs_it_no_longer_holds(s3_uri: str, tmp_path: Path) -> None:
    s = Settings(TLAB_STORAGE=s3_uri, TLAB_STORAGE_CACHE=str(tmp_path / "cache"))
    assert s.storage_path == str(tmp_path / "cache") and s.storage_uri == s3_uri
    tree(tmp_path / "node", {"artifacts/summary.json": b"{}", "artifacts/plots/a.txt": b"mine",
                             "logs/attempt-1/driver.log": b"trained\n"})
    storage.bucket(s).push(tmp_path / "node", JOB)
    assert [a.name for a in artifacts.listing(s, JOB)] == ["plots/a.txt", "summary.json"]
    with os.fdopen(artifacts.open_artifact(s, JOB, "plots/a.txt"), "rb") as f:
        assert f.read() == b"mine"
    storage.sync_logs(s, JOB)
    assert (tmp_path / "cache" / JOB / "logs/attempt-1/driver.log").read_bytes() == b"trained\n"
    storage.delete(s, JOB)  # a dry run's directory goes from the bucket too
    assert storage.bucket(s).ls(JOB) == {}


@pytest.mark.parametrize("argv", [[sys.executable, "-m", "service.scheduler"], [sys.executable, "-m", "service.api"],
                                  [sys.executable, "-m", "service.cli", "up"]])
def test_bad_storage_stops_the_start_with_one_line(argv: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "TLAB_STORAGE": "s3:///nobucket", "TLAB_HOME": str(tmp_path / "home"),
           "REDIS_URL": "redis://127.0.0.1:9/0"}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: TLAB_STORAGE='s3:///nobucket'"), out.stderr


def test_after_a_failed_push_checkpoints_skip_the_bucket_for_a_while(s3_endpoint: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from workers.job import bucket

    monkeypatch.setenv(bucket.ENV, f"s3://nosuch/lab?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1")
    monkeypatch.setattr(bucket, "_failed_at", [-bucket.RETRY_S])
    tree(tmp_path / JOB, {"checkpoint_1/checkpoint.pt": b"x"})
    bucket.push(tmp_path, JOB, prune=True)  # fails: a warning, never the job's failure
    bucket.push(tmp_path, JOB, prune=True)  # within RETRY_S: skipped, no second try
    assert capsys.readouterr().err.count("[tlab] warning: could not copy") == 1
    bucket.push(tmp_path, JOB)  # the end of a run: tries again
    assert capsys.readouterr().err.count("[tlab] warning: could not copy") == 1
