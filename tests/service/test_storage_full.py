"""TLAB_MIN_FREE_GB on a real stack (the session's Ray head, the real API and scheduler) whose storage is a 20 MiB
tmpfs the test mounts: with the volume nearly full a new job waits saying why, and starts once space is freed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.cli.client import Client
from service.stack.embedded import Stack
from tests.conftest import fill
from tests.service.conftest import tiny
from tests.service.test_e2e import wait_state

pytestmark = pytest.mark.slow


@pytest.fixture()
def stack_env(small_volume: Path) -> dict[str, str]:
    return {"TLAB_STORAGE": str(small_volume / "storage"), "TLAB_MIN_FREE_GB": "0.005"}  # 5 MB


def test_a_new_job_waits_while_storage_is_nearly_full_and_starts_once_space_is_freed(
        stack: Stack, small_volume: Path) -> None:
    filler = fill(small_volume, leave_bytes=1_000_000)
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(tiny(training={"epochs": 2}))["id"]
        deadline, view = time.monotonic() + 60, c.get(job)
        while "storage nearly full" not in (view.get("pending_reason") or "") and time.monotonic() < deadline:
            time.sleep(0.2)
            view = c.get(job)
        assert view["state"] == "queued", view
        assert view["pending_reason"].startswith("storage nearly full: 0.00 GB free at "), view
        assert "TLAB_MIN_FREE_GB=0.005" in view["pending_reason"]
        filler.unlink()
        view = wait_state(c, job, {"succeeded", "failed", "cancelled"}, timeout=180)
        assert view["state"] == "succeeded", view
