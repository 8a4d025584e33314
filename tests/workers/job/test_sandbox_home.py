"""The sandbox seen from inside: the service's home hidden wherever it lies (under a directory the sandbox binds for
the job, here /usr as a ``TLAB_HOME=/usr/local/...`` would be, an empty tmpfs covers it; under /tmp, where every other
test's home is, the sandbox's own /tmp already replaces it), and a PID namespace of its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.job.sandbox import Mounts, bwrap_argv, unavailable

LOOK = "import os, sys; print(sorted(os.listdir(sys.argv[1])))"


@pytest.fixture()
def home_under_usr() -> Iterator[Path]:
    try:
        home = Path(tempfile.mkdtemp(prefix="tlab-home-", dir="/usr/local/share"))
    except OSError as err:
        pytest.skip(f"cannot make a directory under /usr/local/share here ({err}): run as root")
    try:
        home.chmod(0o755)  # (mkdtemp: 0700) a home as a user makes one, readable by the job's uid but for the cover
        (home / "admin.token").write_text("tl_secret\n")
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")
def test_a_home_under_a_bound_directory_is_covered(home_under_usr: Path, tmp_path: Path) -> None:
    def seen(hidden: list[Path]) -> str:
        argv = bwrap_argv([sys.executable, "-c", LOOK, str(home_under_usr)], {"PATH": "/usr/bin:/bin"},
                          Mounts(writable=tmp_path, hidden=hidden))
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert seen([]) == "['admin.token']"  # /usr is bound for the job: without the covering, the home shows
    assert seen([home_under_usr]) == "[]"


@pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")
def test_a_job_sees_only_its_own_processes(tmp_path: Path) -> None:
    """Its own PID namespace: the host's processes (this test's among them) are not there to see or signal."""
    argv = bwrap_argv([sys.executable, "-c", "import os; print(sorted(int(p) for p in os.listdir('/proc') "
                       "if p.isdigit()))"], {"PATH": "/usr/bin:/bin"}, Mounts(writable=tmp_path))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pids = json.loads(done.stdout)  # a list of ints, printed by the sandboxed Python
    assert len(pids) <= 4 and max(pids) < 10, pids  # bwrap, setpriv's child and itself: a handful, numbered anew
