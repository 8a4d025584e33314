"""A payload that cannot start says why in the job's failure, and a checkout run without ``pip install`` (a lent GPU
machine's: the project on ``PYTHONPATH=.``) starts its payload in the sandbox as an installed one does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from workers.job.logs import StderrTail
from workers.job.sandbox import Mounts, bwrap_argv, payload_env, unavailable
from workers.on_ray.supervisor import outcome, unreported

ROOT = Path(__file__).resolve().parents[3]
DIES = "import sys; sys.stderr.write('starting\\n'); sys.stderr.write('No module named workers\\n\\n'); sys.exit(1)"


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
