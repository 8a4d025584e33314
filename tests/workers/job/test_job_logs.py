"""A job's logs kept in storage: what the processes print is teed into files (capped, final lines kept), and the
API's reader tails and follows them across attempts. Capture runs in a child process: it rewires fds 1 and 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.api import job_logs as reader
from service.core.errors import InvalidInput, JobNotFound

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import os, signal, subprocess, sys, time
from workers.job.logs import also_as, capture

class Stopped(Exception):
    pass

def stop(signum, frame):
    raise Stopped()

signal.signal(signal.SIGTERM, stop)
with capture(sys.argv[1], "job1", "driver", int(sys.argv[2])):
    also_as("rank-0")  # as a 1-worker job's driver does: it trains itself
    try:
        print("a print")
        print("to stderr", file=sys.stderr)
        os.write(1, b"a raw write to fd 1\\n")
        subprocess.run(["echo", "from a child process"], check=True)
        sys.stdout.write("x" * int(sys.argv[3]))
        print("ready", flush=True)
        time.sleep(float(sys.argv[4]))
    except Stopped:
        sys.stdout.write("stopped: the last words, no newline")
"""


def run_child(storage: Path, *, attempt: int = 1, spam: int = 0, sleep: float = 0.0, cap_mb: str = "20",
              term: bool = False) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TLAB_MAX_LOG_MB": cap_mb}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(storage), str(attempt), str(spam), str(sleep)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    if term:
        for line in proc.stdout:
            if line.endswith(b"ready\n"):
                break
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out.decode()


def test_everything_a_process_prints_is_kept_and_still_shown(tmp_path: Path) -> None:
    shown = run_child(tmp_path)
    kept = (tmp_path / "job1" / "logs" / "attempt-1" / "driver.log").read_text()
    assert kept.startswith("[tlab] driver of job job1, attempt 1: pid ")
    for line in ("a print", "to stderr", "a raw write to fd 1", "from a child process", "ready"):
        assert line + "\n" in kept and line in shown
    assert (tmp_path / "job1" / "logs" / "attempt-1" / "rank-0.log").read_text() == kept  # the same file


def test_a_sigterm_keeps_the_last_words(tmp_path: Path) -> None:
    run_child(tmp_path, sleep=60, term=True)
    kept = (tmp_path / "job1" / "logs" / "attempt-1" / "driver.log").read_text()
    assert kept.endswith("ready\nstopped: the last words, no newline")


def test_the_job_logs_are_capped_together_and_the_log_says_so(tmp_path: Path) -> None:
    cap = 0.25  # MB, for all attempts together
    first = run_child(tmp_path, attempt=1, spam=200_000, cap_mb=str(cap))
    assert first.count("x") >= 200_000  # what is not kept is still shown
    second = tmp_path / "job1" / "logs" / "attempt-2" / "driver.log"
    run_child(tmp_path, attempt=2, spam=200_000, cap_mb=str(cap))
    total = sum(f.lstat().st_size for f in (tmp_path / "job1" / "logs").rglob("*.log") if not f.is_symlink())
    assert total <= cap * 2**20 + 2 * 70_000  # the cap, give or take one check's worth per file
    assert "reached their cap of 0.25 MB (TLAB_MAX_LOG_MB)" in second.read_text()


def test_a_log_that_cannot_be_written_stops_the_log_not_the_job(tmp_path: Path) -> None:
    from workers.job.logs import _Tee

    read_fd, write_fd = os.pipe()
    tee = _Tee(tmp_path / "x.log", tmp_path, 2**20, write_fd)
    tee.file.close()  # as a full disk or a stale NFS handle would make the next write fail
    tee.write(b"still shown\n")  # no exception: the pump goes on, so the job's prints never hit a closed pipe
    assert tee.full and os.read(read_fd, 100) == b"still shown\n"
    os.close(read_fd)
    os.close(write_fd)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(text)


def test_tail_and_which_file_a_rank_reads(tmp_path: Path) -> None:
    logs = tmp_path / "j" / "logs"
    write(logs / "attempt-1" / "driver.log", "".join(f"line {i}\n" for i in range(5000)))
    write(logs / "attempt-2" / "driver.log", "d\n")
    write(logs / "attempt-2" / "rank-1.log", "r1\n")
    assert reader.attempts(tmp_path, "j") == [1, 2]
    assert reader.pick_attempt(tmp_path, "j", None) == 2 and reader.pick_attempt(tmp_path, "nobody", None) is None
    with pytest.raises(JobNotFound, match=r"attempt 3 kept no logs \(attempts with logs: 1, 2\)"):
        reader.pick_attempt(tmp_path, "j", 3)
    assert reader.file_of(tmp_path, "j", "0", 2).name == "driver.log"  # trained in the driver
    assert reader.file_of(tmp_path, "j", "1", 2).name == "rank-1.log"
    one = reader.file_of(tmp_path, "j", "0", 1)
    assert reader.tail(tmp_path, one, 3) == "line 4997\nline 4998\nline 4999\n"
    assert reader.tail(tmp_path, one, None).count("\n") == 5000 and reader.tail(tmp_path, one, 0) == ""
    assert reader.tail(tmp_path, tmp_path / "missing.log", 5) == ""


def test_a_follow_sends_whole_lines_once_across_attempts_and_resumes(tmp_path: Path) -> None:
    logs = tmp_path / "j" / "logs"
    write(logs / "attempt-1" / "rank-0.log", "one\ntw")
    follow = reader._Follow(tmp_path, "j", "0", None)
    events = [follow.read(ended=False) for _ in range(3)]
    assert [e for e, _ in events if e] == ["id: 1:0\nevent: log\ndata: one\n\n"]  # 'tw' waits for its end
    write(logs / "attempt-1" / "rank-0.log", "o\n")
    write(logs / "attempt-2" / "rank-0.log", "three")
    assert follow.read(ended=False)[0] == "id: 1:4\nevent: log\ndata: two\n\n"
    assert follow.read(ended=False) == (None, False)  # on to attempt 2
    assert follow.read(ended=False) == (None, False)  # 'three' is not a whole line while the job runs
    assert follow.read(ended=True)[0] == "id: 2:0\nevent: log\ndata: three\n\n"  # ended: the rest is sent
    assert follow.read(ended=True) == (None, True)
    resumed = reader._Follow(tmp_path, "j", "0", reader.parse_cursor("1:4"))
    assert resumed.read(ended=True)[0] == "id: 1:4\nevent: log\ndata: two\n\n"
    with pytest.raises(InvalidInput, match="Last-Event-ID"):
        reader.parse_cursor("1712345678901-0")


def test_rank_0_is_its_own_file_or_the_drivers_never_both(tmp_path: Path) -> None:
    """A multi-worker job's driver writes before rank 0 exists: a follow of rank 0 waits for rank 0's own file
    rather than reading the driver's and going on at that offset in another file."""
    attempt = tmp_path / "j" / "logs" / "attempt-1"
    write(attempt / "driver.log", "driver line\n")
    follow = reader._Follow(tmp_path, "j", "0", None)
    assert [follow.read(ended=False) for _ in range(2)] == [(None, False), (None, False)]
    write(attempt / "rank-0.log", "rank 0 line\n")
    assert follow.read(ended=False)[0] == "id: 1:0\nevent: log\ndata: rank 0 line\n\n"
    early = tmp_path / "k" / "logs" / "attempt-1"  # a job that failed before training: its driver's log
    write(early / "driver.log", "Traceback\n")
    failed = reader._Follow(tmp_path, "k", "0", None)
    assert failed.read(ended=False) == (None, False) and failed.read(ended=False) == (None, False)
    assert failed.read(ended=True)[0] == "id: 1:0\nevent: log\ndata: Traceback\n\n"


def test_a_follow_of_a_growing_file_sees_each_line(tmp_path: Path) -> None:
    path = tmp_path / "j" / "logs" / "attempt-1" / "rank-0.log"
    follow = reader._Follow(tmp_path, "j", "0", None)
    got = []
    for i in range(20):
        write(path, f"{i}\n")
        time.sleep(0.001)
        event, _ = follow.read(ended=False)
        while event is None and follow.attempt == 0:  # the first read finds attempt 1
            event, _ = follow.read(ended=False)
        got += [line.removeprefix("data: ") for line in (event or "").splitlines() if line.startswith("data: ")]
    assert got == [str(i) for i in range(20)]


@pytest.mark.parametrize("planted", ["logs", "logs/attempt-1", "logs/attempt-1/driver.log"])
def test_a_link_a_job_planted_in_its_directory_is_never_followed_to_write_a_log(tmp_path: Path, planted: str) -> None:
    """A job's sandboxed code writes in its own directory; the process that keeps its log (root, maybe) must not
    append through a link it planted there: the capture refuses, and the target is untouched."""
    from workers.job.logs import capture

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "driver.log").write_text("precious\n")
    link = tmp_path / "storage" / "job" / planted
    link.parent.mkdir(parents=True)
    link.symlink_to(outside / "driver.log" if planted.endswith(".log") else outside)
    with pytest.raises(OSError), capture(tmp_path / "storage", "job", "driver", 1):
        print("a line for the log")
    assert sorted(p.name for p in outside.iterdir()) == ["driver.log"]
    assert (outside / "driver.log").read_text() == "precious\n"
