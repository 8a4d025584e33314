"""kill -9 of a 1-worker job's driver (the process that trains: what the kernel's OOM killer picks) on a real Ray
head with the real API and scheduler: the job goes back to the queue, resumes from its last checkpoint, and ends
succeeded with every epoch once; the retry says what happened in one line (service.scheduler.deaths)."""

from __future__ import annotations

import re
import signal
import time

import psutil
import pytest

from service.cli.client import Client
from service.stack.embedded import Stack
from tests.service.conftest import tiny
from tests.service.test_e2e import epochs_in, wait_state

pytestmark = pytest.mark.slow
EPOCHS = 25


def driver_of(job: str) -> psutil.Process:
    """The Ray job's entrypoint process for ``job`` (``python -m workers.run --job <id>``)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if "workers.run" in cmd and job in cmd and not any(c.endswith("sh") for c in cmd[:1]):
                return p
        time.sleep(0.2)
    raise AssertionError(f"no driver process of {job}")


@pytest.mark.drill
def test_kill9_of_a_one_worker_driver_is_retried_from_its_checkpoint(stack: Stack) -> None:
    spec = tiny(training={"epochs": EPOCHS, "batch_size": 2}, teleport={"enabled": False})  # ~0.4 s an epoch
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(spec, name="killed")["id"]
        seen = 0
        for event in c.events(job):
            seen += event.kind == "metric"
            if seen == 6:  # past TLAB_CHECKPOINT_EVERY_S: a checkpoint is on disk
                break
        driver_of(job).send_signal(signal.SIGKILL)
        view = wait_state(c, job, {"succeeded", "failed", "cancelled"}, timeout=240)
        assert view["state"] == "succeeded", view
        events = list(c.events(job))
        assert epochs_in(events) == list(range(EPOCHS))  # every epoch once, across the two attempts
        assert view["attempts"] == 2 and view["summary"]["epochs"] == EPOCHS
        said = [e.data["message"] for e in events if e.kind == "log" and e.data.get("level") == "warning"]
        line = next(m for m in said if m.startswith("driver killed"))
        found = re.fullmatch(r"driver killed by SIGKILL at epoch (\d+) \(out of memory(\?|:) [^)]*peak RSS "
                             r"[\d.]+ GB[^)]*\); retrying from epoch (\d+), attempt 2 of 3", line)
        assert found, line
        print(line)
        assert 1 <= int(found[3]) <= int(found[1]) >= 6, line
        starts = [e.data["resumed_from_epoch"] for e in events if e.data.get("kind") == "start"]
        assert starts == [0, int(found[3])]  # the second attempt went on from the checkpoint the line named
    # ended: the scheduler keeps its newest checkpoint only (TLAB_KEEP_ENDED_CHECKPOINTS=1), and its artifacts
    run_dir = stack.home / "storage" / job
    deadline = time.monotonic() + 30
    while len(list(run_dir.glob("checkpoint_*"))) > 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(run_dir.glob("checkpoint_*"))) == 1 and (run_dir / "artifacts" / "model.safetensors").is_file()
