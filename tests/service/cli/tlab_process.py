"""Running the ``tlab`` console script as a user does, in a subprocess (``test_cli``, ``test_cli_ray``, API tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TLAB = str(Path(sys.executable).parent / "tlab")


def tlab(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TLAB, *args], capture_output=True, text=True, timeout=240, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})


def closed_pipe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``tlab ARGS`` writing into a pipe whose reader has gone (``tlab ls | head -1`` once head has its line)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([TLAB, *args], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=240,
                              env=None if env is None else {**os.environ, **env})
    finally:
        os.close(write_end)
