"""The user's own loop through the REST API on the real stack (Redis, Ray, HTTP): the example package uploaded
with the CLI's zipper runs on 2 DDP workers (Ray Train), reports each epoch once, teleports, and leaves the
model as an artifact, with the file its loop wrote to ``ctx.artifacts_dir`` beside it (listed, served, pulled)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from service.cli.client import Client
from service.cli.code_zip import upload
from service.stack.embedded import Stack
from tests.service.api.test_artifacts import pull
from tests.service.test_code_packages import wait_end

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop"


def test_an_own_loop_trains_on_two_ddp_workers_through_the_api(stack: Stack, tmp_path: Path) -> None:
    with Client(stack.url, stack.admin_token) as c:
        spec = {
            "training": {"entrypoint": "own_loop.loop:train", "entrypoint_args": {"width": 16, "samples": 256},
                         "epochs": 2, "batch_size": 64},
            "optimizer": {"name": "adam", "lr": 0.01},
            "teleport": {"epochs": [0], "batches": 1, "batch_size": 32, "steps": 2, "cap": 50.0, "budget": None},
            "resources": {"workers": 2},
            "code": {"package": upload(c, str(EXAMPLE))["package"]},
        }
        job = c.submit(spec, name="own-loop")["id"]
        view = wait_end(c, job)
        assert view["state"] == "succeeded", view.get("failure_reason")
        metrics = c.json("GET", f"/v1/experiments/{job}/metrics")
        assert [p["epoch"] for p in metrics["points"]] == [0, 1]
        assert metrics["teleports"] and all(0 <= p["test_acc"] <= 1 for p in metrics["points"])
        assert view["summary"]["epochs"] == 2 and view["summary"]["teleport_batches"] == 1
        items = {a["name"]: a for a in c.json("GET", f"/v1/experiments/{job}/artifacts")["items"]}
        assert {"model.safetensors", "checkpoint.pt", "metrics.csv", "notes.txt"} <= set(items), items
        # the loop's own file (rank 0 wrote it to ctx.artifacts_dir after its last epoch): listed, served, pulled
        notes = f"spirals: width 16, test accuracy {metrics['points'][-1]['test_acc']:.4f}\n".encode()
        assert items["notes.txt"]["bytes"] == len(notes)
        assert items["notes.txt"]["sha256"] == hashlib.sha256(notes).hexdigest()
        assert c.request("GET", f"/v1/experiments/{job}/artifacts/notes.txt").content == notes
    done = pull(stack, stack.admin_token, job, tmp_path / "pulled")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pulled" / "notes.txt").read_bytes() == notes
    assert {p.name for p in (tmp_path / "pulled").iterdir()} == set(items)  # every listed file, nothing else
