"""A failed job's ``failure_reason`` is one line of at most 300 characters with the user's cause; the
traceback stays in the job's log. End to end on the real stack, and the scheduler's fallback on Ray's
own message."""

from __future__ import annotations

import time

import numpy as np
import pytest

from api_schemas.reasons import MAX_REASON, one_line
from service.cli.client import Client
from service.launch.ray_reasons import reason_from_ray
from service.stack.embedded import Stack
from tests.service.conftest import tiny

RAY_MESSAGE = """Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):
Traceback (most recent call last):
  File "/opt/tlab/workers/run.py", line 92, in job_main
ray.train.WorkerGroupError: Training failed due to worker errors:
[Rank 0 Error Snippet]:
TLAB-FAILURE: dataset.path: /data/x.npz: no such file — set dataset.path to a .npz with arrays X, y
(raylet) some shutdown chatter
"""


def test_the_marked_line_wins_over_rays_chatter() -> None:
    expected = "dataset.path: /data/x.npz: no such file — set dataset.path to a .npz with arrays X, y"
    assert reason_from_ray(RAY_MESSAGE) == expected
    died = 'Job entrypoint command failed with exit code 1, last available logs:\n  File "x"\nModuleNotFoundError: x\n'
    assert reason_from_ray(died) == "ModuleNotFoundError: x"  # no mark: the last line
    assert reason_from_ray("") == ""
    assert one_line("a\n  b\tc") == "a b c" and len(one_line("z" * 5000)) == MAX_REASON


def wait_ended(c: Client, job: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = c.get(job)
        if view["state"] in {"succeeded", "failed", "cancelled"}:
            return view
        time.sleep(0.3)
    raise AssertionError(f"{job} did not end in {timeout} s; last state {view['state']}")


@pytest.mark.slow
def test_a_job_whose_dataset_is_missing_fails_with_one_short_line(stack: Stack) -> None:
    missing = (stack.home / "data" / "x.npz").resolve()  # under the data root: found at submit, gone at run
    missing.parent.mkdir(parents=True, exist_ok=True)
    np.savez(missing, X=np.zeros((4, 2)), y=np.zeros(4, dtype=np.int64))
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(tiny(dataset={"name": "npz", "path": str(missing)}), name="missing-data")["id"]
        missing.unlink()  # the worker's own check, the second line after the one at submit, must say it
        view = wait_ended(c, job)
        reason = view["failure_reason"]
        assert view["state"] == "failed", view
        assert reason.startswith(f"dataset.path: {missing}: no such file"), reason
        assert "\n" not in reason and len(reason) <= MAX_REASON and "Traceback" not in reason
        assert "Error" not in reason  # not Ray's WorkerGroupError, not a type name: our own message
        listed = [j for j in c.json("GET", "/v1/experiments")["items"] if j["id"] == job]
        assert listed and listed[0]["failure_reason"] == reason
        logs = c.request("GET", f"/v1/experiments/{job}/logs").text
        assert "Traceback (most recent call last)" in logs and f"TLAB-FAILURE: {reason}" in logs


@pytest.mark.slow
def test_a_crafted_cifar_pickle_under_a_data_root_never_runs_on_the_worker(stack: Stack, tmp_path) -> None:  # noqa: ANN001
    """The crafted-pickle payload on the real stack: a CIFAR batch whose unpickling would run ``touch`` sits under the
    data root; the job fails with the refusal in one line and the command never ran on the worker."""
    from tests.workers.train.test_safe_loading import Payload, cifar_bytes, write_cifar10

    root = (stack.home / "data").resolve()
    marker = tmp_path / "pwned"
    evil = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1], b"x": Payload(f"touch {marker}")}
    write_cifar10(root / "cifar-10-batches-py", test_batch=cifar_bytes(evil, 2))
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(tiny(dataset={"name": "cifar10", "root": str(root)}), name="crafted-pickle")["id"]
        view = wait_ended(c, job)
    reason = view["failure_reason"]
    assert view["state"] == "failed", view
    assert reason.startswith(f"{root / 'cifar-10-batches-py' / 'test_batch'}: refused: the pickle references"), reason
    assert "system" in reason and "nothing in it was run" in reason and "\n" not in reason
    assert not marker.exists()  # the payload never ran
