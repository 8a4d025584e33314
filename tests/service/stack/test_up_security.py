"""A root ``tlab up`` whose home its service user cannot pass is refused at start, with one line naming the closed
directory and the way out (what a started ``tlab up`` keeps private: ``tests/security/test_tlab_up.py``)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.conftest import service_user_env


@pytest.mark.skipif(os.geteuid() != 0, reason="the service user is a root tlab up's")
@pytest.mark.skipif(bool(service_user_env()), reason="this checkout is closed to other users: no service user here")
def test_a_root_tlab_up_whose_home_the_service_user_cannot_reach_stops_with_one_line(tmp_path: Path) -> None:
    """pytest's temp root is 0700, as /root is: nothing opens it, the start is refused, naming it and the way out."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS")}
    env["TLAB_HOME"] = str(tmp_path / "home")
    out = subprocess.run([str(Path(sys.executable).parent / "tlab"), "up"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: TLAB_HOME {tmp_path / 'home'} lies under ") and "TLAB_HOME=/var/lib/tlab" in last
    closed = Path(last.split(" lies under ")[1].split(" (mode")[0])
    assert stat.S_IMODE(closed.stat().st_mode) == 0o700  # left as it was
    assert not (tmp_path / "home" / "redis").exists()  # nothing started
