"""A sandboxed job's private /tmp is a tmpfs of ``TLAB_SANDBOX_TMP_MB``: a job that fills it gets ENOSPC there,
not the node's memory (run in a real bubblewrap sandbox; skipped where none can run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workers.job.sandbox import DEFAULT_TMP_MB, Mounts, bwrap_argv, tmp_bytes, unavailable

WRITE = """
import sys
n = int(sys.argv[1])
try:
    with open("/tmp/fill", "wb") as f:
        for _ in range(n):
            f.write(b"0" * 1024 * 1024)
            f.flush()
    print("wrote", n)
except OSError as err:
    print("refused", err.errno)
"""


def test_the_tmp_size_is_the_setting_else_the_default() -> None:
    assert tmp_bytes({"TLAB_SANDBOX_TMP_MB": "64"}) == 64 * 1024 * 1024
    assert tmp_bytes({}) == tmp_bytes({"TLAB_SANDBOX_TMP_MB": "lots"}) == DEFAULT_TMP_MB * 1024 * 1024


@pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")
def test_a_job_that_fills_its_tmp_gets_enospc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLAB_SANDBOX_TMP_MB", "16")

    def write(mb: int) -> str:
        argv = bwrap_argv([sys.executable, "-c", WRITE, str(mb)], {"PATH": "/usr/bin:/bin"}, Mounts(writable=tmp_path))
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert write(8) == "wrote 8"
    assert write(32) == "refused 28"  # ENOSPC at 16 MB
