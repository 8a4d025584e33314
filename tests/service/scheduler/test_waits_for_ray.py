"""The scheduler started before Ray's dashboard answers waits for it, saying so, instead of exiting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import _free_port


def test_the_scheduler_waits_for_ray_saying_so(redis_server: str, tmp_path: Path) -> None:
    env = {**os.environ, "REDIS_URL": redis_server, "RAY_ADDRESS": f"http://127.0.0.1:{_free_port()}",
           "TLAB_HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    log = tmp_path / "scheduler.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "service.scheduler"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "waiting for Ray at" not in log.read_text():
            assert proc.poll() is None, f"the scheduler exited ({proc.returncode}): {log.read_text()[-1500:]}"
            assert time.monotonic() < deadline, log.read_text()[-1500:]
            time.sleep(0.2)
        time.sleep(2)
        assert proc.poll() is None, log.read_text()[-1500:]  # still waiting, not gone
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-1500:]  # stops cleanly while it waits
