"""A payload that cannot start says why in the job's failure and is not tried again (one that started and crashed
is), and a checkout run without ``pip install`` (a lent GPU machine's: the project on ``PYTHONPATH=.``) starts its
payload in the sandbox as an installed one does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from api_schemas import ExperimentSpec
from workers.job.logs import StderrTail
from workers.job.orders import Orders, Outcome, split_result
from workers.job.sandbox import Mounts, bwrap_argv, payload_env, unavailable
from workers.on_ray import supervisor
from workers.on_ray.supervisor import outcome, run_payload, unreported
from workers.train.failure import JobFailed

ROOT = Path(__file__).resolve().parents[3]
DIES = "import sys; sys.stderr.write('starting\\n'); sys.stderr.write('No module named workers\\n\\n'); sys.exit(1)"
CRASHES = ("import json, os, sys\nfrom workers.job.orders import say_started\n"  # as workers.payload starts,
           "say_started(json.loads(sys.stdin.read())['result_fd'])\n"  # then dies
           "sys.stderr.write('Segmentation fault\\n')\nos._exit(1)")


def test_the_payloads_last_stderr_line_is_passed_on_and_kept(capfd: pytest.CaptureFixture[str]) -> None:
    read, write = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", DIES], stderr=write)
    os.close(write)
    tail = StderrTail(read)
    assert proc.wait(timeout=60) == 1
    assert tail.last_line() == "No module named workers"
    assert "starting\nNo module named workers" in capfd.readouterr().err  # the job's log still has all of it


def test_a_payload_that_ended_unreported_names_what_it_said_else_its_memory_when_killed() -> None:
    assert outcome("", None) is None  # neither the payload nor a rank of its gang said how it ended
    said = unreported(1, "ModuleNotFoundError: No module named 'workers'")
    assert said.error == ("the training process ended with exit status 1: ModuleNotFoundError: No module named "
                          "'workers'") and said.retried
    assert unreported(1, "").error == "the training process ended with exit status 1 and said nothing"
    for killed in (-signal.SIGKILL, 128 + signal.SIGKILL):  # bare, and through bwrap
        assert unreported(killed, "").error.endswith("(killed: out of memory?)")
        assert unreported(killed, "epoch 3").error.endswith("(killed: out of memory?); its last line: epoch 3")
    assert len(unreported(1, "x" * 5000).error) < 400


@pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")
def test_a_sandboxed_payload_finds_our_packages_without_an_install(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # no site (-S): neither the editable install's finder nor site-packages; the checkout off the supervisor's path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and Path(p).resolve() != ROOT])
    probe = ("import objstore, workers\nprint(workers.__path__[0])\n"
             "try:\n    import service\nexcept ImportError:\n    print('no service')")
    argv = bwrap_argv([sys.executable, "-S", "-c", probe], payload_env(None), Mounts(writable=tmp_path))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(ROOT / "workers"), "no", "service"]  # ours mounted, the control plane not


def payload(code: str, tries: Path) -> list[str]:
    """A payload's command line that counts its starts in ``tries``, then runs ``code``."""
    return [sys.executable, "-c", f"open({str(tries)!r}, 'a').write('x')\n{code}"]


def test_a_payload_that_never_started_fails_at_once_and_one_that_crashed_after_its_start_is_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    orders = Orders(ExperimentSpec().model_dump_json(), "job-1", "", str(tmp_path), -1)  # (no Redis: no records)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    crashed = run_payload(orders, payload(CRASHES, tmp_path / "crashed"), env)
    assert crashed.retried and crashed.error == "the training process ended with exit status 1: Segmentation fault"
    # through the supervisor's loop (TLAB_MAX_FAILURES 3): one try, no retry note (it would need Redis), one line
    monkeypatch.setattr(supervisor, "payload_argv", lambda *args: (payload(DIES, tmp_path / "never"), env))
    with pytest.raises(JobFailed, match=r"^the training process could not start, exit status 1: No module named "
                                         r"workers; not retried \(a retry would meet the same\)$"):
        supervisor.supervise(ExperimentSpec(), "job-2", "", str(tmp_path), 3, None, None, [])
    assert (tmp_path / "never").read_text() == "x"
    killed = unreported(-signal.SIGKILL, "", started=False)  # killed before it started (its memory): tried again
    assert killed.retried and killed.error.endswith("(killed: out of memory?)")


def test_the_real_payload_says_it_started_before_its_outcome(tmp_path: Path) -> None:
    read, write = os.pipe()
    orders = Orders("not a spec", "job-3", "redis://unused", str(tmp_path), write)  # fails once it has started
    proc = subprocess.Popen([sys.executable, "-m", "workers.payload"], stdin=subprocess.PIPE, pass_fds=[write],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.DEVNULL)
    os.close(write)
    proc.communicate(json.dumps(asdict(orders)).encode(), timeout=120)
    with os.fdopen(read) as result:
        started, raw = split_result(result.read())
    assert started and proc.returncode == 1
    assert "spec" in Outcome(**json.loads(raw)).error  # its own account follows the word
