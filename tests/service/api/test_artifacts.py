"""Artifacts: a finished job keeps model.safetensors, checkpoint.pt, metrics.csv and summary.json;
the API lists them with sha256, streams them (Range too) to the owner or an admin only, and never serves a
name outside the job's directory; ``tlab pull`` writes them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from api_schemas import ExperimentSpec
from service.api import artifacts
from service.cli.artifacts import file_sha256
from service.core.errors import InvalidInput, JobNotFound
from service.core.settings import Settings
from service.stack.embedded import Stack
from tests.service.cli.tlab_process import TLAB
from tests.service.conftest import Api, tiny
from tests.service.test_failure_reasons import wait_ended
from workers.job.artifacts import record_digests

JOB = "18f3a2b4c5d-9e1f2a"


@pytest.fixture()
def storage(tmp_path: Path) -> tuple[Settings, Path]:
    """A job's artifacts directory with a file, a hidden half-written one, and a symlink leading outside."""
    settings = Settings(TLAB_STORAGE=str(tmp_path / "storage"))
    root = tmp_path / "storage" / JOB / "artifacts"
    (root / "plots").mkdir(parents=True)
    (root / "plots" / "a.txt").write_text("mine")
    (root / ".model.safetensors.tmp").write_text("half")
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (root / "leak.txt").symlink_to(secret)
    (tmp_path / "storage" / JOB / "checkpoint_2026-01-01_00-00-00.000001").mkdir()
    (tmp_path / "storage" / JOB / "checkpoint_2026-01-01_00-00-00.000001" / "checkpoint.pt").write_text("old")
    (tmp_path / "storage" / JOB / "checkpoint_2026-01-02_00-00-00.000001").mkdir()
    (tmp_path / "storage" / JOB / "checkpoint_2026-01-02_00-00-00.000001" / "checkpoint.pt").write_text("new")
    return settings, root


def test_names_never_leave_the_jobs_directory(storage: tuple[Settings, Path]) -> None:
    settings, root = storage
    listed = {a.name: a for a in artifacts.listing(settings, JOB)}
    assert set(listed) == {"plots/a.txt", "checkpoint.pt"}  # not the hidden file, not the symlink out
    assert listed["plots/a.txt"].sha256 is None and listed["plots/a.txt"].sha256_note == artifacts.NOT_EXPORTED
    assert record_digests(root) == []  # the export's digests (the link and the hidden file left out)
    listed = {a.name: a for a in artifacts.listing(settings, JOB)}
    assert set(listed) == {"plots/a.txt", "checkpoint.pt", "SHA256SUMS"}
    assert listed["plots/a.txt"].sha256 == hashlib.sha256(b"mine").hexdigest()
    assert listed["SHA256SUMS"].sha256 == hashlib.sha256((root / "SHA256SUMS").read_bytes()).hexdigest()
    assert listed["checkpoint.pt"].sha256 is None and listed["checkpoint.pt"].sha256_note == artifacts.STAND_IN
    # no checkpoint.pt exported (a driver killed before it could): the newest Ray Train checkpoint stands in
    assert read(settings, "checkpoint.pt") == b"new"
    assert read(settings, "plots/a.txt") == b"mine"
    for bad in ["../checkpoint_2026-01-02_00-00-00.000001/checkpoint.pt", "/etc/passwd", "plots/../../x", "",
                "a\\..\\b", "a\x00b"]:
        with pytest.raises(InvalidInput) as err:
            artifacts.open_artifact(settings, JOB, bad)
        assert err.value.field == "name"
    for missing in ["leak.txt", ".model.safetensors.tmp", "plots", "nothing.bin"]:
        with pytest.raises(JobNotFound):
            artifacts.open_artifact(settings, JOB, missing)


def read(settings: Settings, name: str) -> bytes:
    with os.fdopen(artifacts.open_artifact(settings, JOB, name), "rb") as f:
        return f.read()


def pull(stack: Stack, token: str, job: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TLAB, "--url", stack.url, "--token", token, "pull", job, "-o", str(out), "-q"],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "TLAB_HOME": "/nonexistent"})


@pytest.mark.slow
def test_a_finished_job_keeps_its_artifacts(stack: Stack, tmp_path: Path) -> None:
    api = Api(stack)
    api.add_user("ann")
    api.add_user("bob")
    spec = tiny(training={"epochs": 3, "batch_size": 64})
    with api.client("ann") as c:
        job = c.post("/v1/experiments", json={"spec": spec}).json()["id"]
    from service.cli.client import Client

    with Client(stack.url, api.tokens["ann"]) as c:
        assert wait_ended(c, job, timeout=600)["state"] == "succeeded"
    with api.client("ann") as c:
        items = {a["name"]: a for a in c.get(f"/v1/experiments/{job}/artifacts").json()["items"]}
        assert {"model.safetensors", "checkpoint.pt", "metrics.csv", "summary.json"} <= set(items), items
        files = {}
        for name, item in items.items():
            r = c.get(f"/v1/experiments/{job}/artifacts/{name}")
            assert r.status_code == 200 and r.headers["accept-ranges"] == "bytes"
            files[name] = r.content
            assert len(r.content) == item["bytes"] and hashlib.sha256(r.content).hexdigest() == item["sha256"]
        r = c.get(f"/v1/experiments/{job}/artifacts/model.safetensors", headers={"Range": "bytes=10-99"})
        assert r.status_code == 206 and r.content == files["model.safetensors"][10:100]
        assert r.headers["content-range"] == f"bytes 10-99/{items['model.safetensors']['bytes']}"
        r = c.get(f"/v1/experiments/{job}/artifacts/..%2F..%2F{job}%2Fcheckpoint.pt")
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "name", r.text
    with api.client("bob") as c:  # another user's job: neither the list nor a file
        assert c.get(f"/v1/experiments/{job}/artifacts").status_code == 403
        assert c.get(f"/v1/experiments/{job}/artifacts/model.safetensors").status_code == 403
    with api.client() as c:  # an admin may
        assert c.get(f"/v1/experiments/{job}/artifacts/summary.json").json()["epochs"] == 3

    # the weights are safetensors that load into the model the spec builds
    (tmp_path / "m.safetensors").write_bytes(files["model.safetensors"])
    weights = load_file(tmp_path / "m.safetensors")
    from workers.train.datasets import load_dataset
    from workers.train.models import build_model_for

    parsed = ExperimentSpec.model_validate(spec)
    model = build_model_for(parsed.model, load_dataset(parsed.dataset))
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in
                                                               model.state_dict().items()}
    model.load_state_dict(weights)  # strict: every name and shape
    (tmp_path / "c.pt").write_bytes(files["checkpoint.pt"])
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert state["epoch"] == 3 and all(torch.equal(state["model"][k], weights[k]) for k in weights)
    assert len(files["metrics.csv"].decode().splitlines()) == 1 + 3
    assert json.loads(files["summary.json"])["complete"] is True

    # tlab pull writes them all, byte for byte; a second pull finds them there
    out = tmp_path / "pulled"
    done = pull(stack, api.tokens["ann"], job, out)
    assert done.returncode == 0, done.stderr
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    again = pull(stack, api.tokens["ann"], job, out)
    assert again.returncode == 0 and not list(out.rglob("*.part")), again.stderr
    refused = pull(stack, api.tokens["bob"], job, tmp_path / "bob")
    assert refused.returncode == 1 and "belongs to another user" in refused.stderr


TRIAL_LIMIT_S = 3  # each trial's time limit (base.resources.time_limit_s): far less than its 1000 epochs take


@pytest.mark.slow
def test_a_sweep_offers_its_best_trials_weights(stack: Stack, tmp_path: Path) -> None:
    """The best trial's artifacts are the sweep's (listed, served, `tlab pull SWEEP`); and each trial stops at its
    own time limit (Tune's stop criterion) as a trial stopped early, not a failure, while the sweep's own limit
    (``time_limit_s``, the scheduler's) is another, longer one."""
    from service.cli.client import Client
    from tests.service.conftest import wait_ray_idle

    base = tiny(training={"epochs": 1000, "max_steps_per_epoch": 1},
                resources={"cpus_per_worker": 0.9, "time_limit_s": TRIAL_LIMIT_S})
    body = {"base": base, "search_space": {"optimizer.lr": {"grid": [0.0001, 0.1]}}, "max_concurrent_trials": 2,
            "metric": "train_loss", "mode": "min", "time_limit_s": 600}
    wait_ray_idle(stack)
    with Client(stack.url, stack.admin_token) as c:
        sweep = c.json("POST", "/v1/sweeps", json=body)["id"]
        list(c.events(sweep))  # until the sweep ends
        view = c.json("GET", f"/v1/sweeps/{sweep}")
        assert view["job"]["state"] == "succeeded", view["job"]
        limited = f"time limit of {TRIAL_LIMIT_S:g} s reached at epoch "
        rows = [(t["state"], t["stopped_early"], 1 <= t["epochs"] < 1000, (t["reason"] or "").startswith(limited))
                for t in view["trials"]]
        assert rows == [("stopped early", True, True, True)] * 2, view["trials"]
        items = {a["name"] for a in c.json("GET", f"/v1/sweeps/{sweep}/artifacts")["items"]}
        assert {"model.safetensors", "checkpoint.pt", "metrics.csv", "summary.json"} <= items, items
        summary = json.loads(c.request("GET", f"/v1/sweeps/{sweep}/artifacts/summary.json").content)
        assert summary["trial"] == view["best"]["trial"] and summary["config"] == view["best"]["config"]
        assert summary["epochs"] == view["best"]["epochs"] and summary["complete"] is False  # its last checkpoint
        weights = c.request("GET", f"/v1/sweeps/{sweep}/artifacts/model.safetensors").content
        listed = {a["name"]: a["sha256"] for a in c.json("GET", f"/v1/sweeps/{sweep}/artifacts")["items"]}
        assert hashlib.sha256(weights).hexdigest() == listed["model.safetensors"]
    # tlab pull SWEEP fetches the best trial's files, the weights byte for byte
    done = pull(stack, stack.admin_token, sweep, tmp_path / "pulled")
    assert done.returncode == 0, done.stderr
    pulled = {p.name: p for p in (tmp_path / "pulled").iterdir()}
    assert set(pulled) == set(listed) and pulled["model.safetensors"].read_bytes() == weights
    assert all(file_sha256(p) == listed[name] for name, p in pulled.items())
