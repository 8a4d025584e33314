"""A user's own code package on the real stack (real Redis, Ray, HTTP): the example GPT-style LM (tied embedding
and LM head, nn.MultiheadAttention, GPT-2's Conv1D) on Python's own source text, uploaded with the CLI's zipper,
trained with teleport on 2 DDP workers through the REST API; a sweep over ``model.args``; a broken package failing
in one line that names the user's file and line."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from service.cli.client import Client
from service.cli.code_zip import upload
from service.stack.embedded import Stack

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_lm"


def lm_spec(package: str, **training: object) -> dict:
    return {
        "model": {"kind": "custom", "factory": "tiny_lm.model:gpt", "args": {"d": 16, "heads": 2, "max_len": 16}},
        "dataset": {"name": "custom", "factory": "tiny_lm.data:python_source",
                    "args": {"seq_len": 16, "stride": 16, "max_chars": 4000}},
        "training": {"epochs": 2, "batch_size": 32, "loss": "tiny_lm.loss:next_token", **training},
        "optimizer": {"name": "adam", "lr": 0.003},
        "teleport": {"epochs": [0], "batches": 1, "batch_size": 1, "steps": 2, "cap": 50.0},
        "code": {"package": package},
    }


def wait_end(c: Client, job: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = c.get(job)
        if view["state"] in ("succeeded", "failed", "cancelled"):
            return view
        time.sleep(0.3)
    raise AssertionError(f"{job} did not end: {view['state']} {view.get('pending_reason')}")


def test_a_code_package_trains_with_teleport_through_the_api(stack: Stack) -> None:
    with Client(stack.url, stack.admin_token) as c:
        first = upload(c, str(EXAMPLE))
        assert first["uploaded"] and first["package"].startswith("sha256:")
        assert upload(c, str(EXAMPLE)) == {**{k: first[k] for k in ("package", "bytes")}, "uploaded": False}
        spec = lm_spec(first["package"])  # 2 DDP ranks (a gang the driver leads), each with a teleport sample
        spec.update(resources={"workers": 2, "cpus_per_worker": 0.9}, teleport={**spec["teleport"], "batch_size": 2})
        job = c.submit(spec, name="tiny-lm")["id"]
        view = wait_end(c, job)
        assert view["state"] == "succeeded", view.get("failure_reason")
        metrics = c.json("GET", f"/v1/experiments/{job}/metrics")
        assert [p["epoch"] for p in metrics["points"]] == [0, 1]
        assert all(p["test_ppl"] > 1 for p in metrics["points"]) and metrics["teleports"]
        assert view["summary"]["epochs"] == 2 and view["spec"]["resources"]["workers"] == 2


def test_a_sweep_over_model_args_runs_each_trial_with_the_package(stack: Stack) -> None:
    with Client(stack.url, stack.admin_token) as c:
        package = upload(c, str(EXAMPLE))["package"]
        base = lm_spec(package, epochs=1)
        base["teleport"] = {"enabled": False}
        body = {"base": base, "search_space": {"model.args.d": {"grid": [8, 16]}}}
        sweep = c.json("POST", "/v1/sweeps", json=body)["id"]
        view = wait_end(c, sweep)
        assert view["state"] == "succeeded", view.get("failure_reason")
        trials = c.json("GET", f"/v1/sweeps/{sweep}")["trials"]
        assert sorted(t["config"]["model.args.d"] for t in trials) == [8, 16]
        assert all(t["state"] == "succeeded" and t["epochs"] == 1 for t in trials)


def test_a_broken_package_fails_naming_the_users_file_and_line(stack: Stack, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(EXAMPLE, broken, ignore=shutil.ignore_patterns("__pycache__"))
    source = broken / "tiny_lm" / "model.py"
    lines = source.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("return GPT("))
    lines.insert(at, "    undefined_name")
    source.write_text("\n".join(lines) + "\n")
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(lm_spec(upload(c, str(broken))["package"]))["id"]
        view = wait_end(c, job)
        assert view["state"] == "failed"
        assert view["failure_reason"] == (f"tiny_lm/model.py:{at + 1}: NameError: name 'undefined_name' is not "
                                          "defined")
        logs = c.request("GET", f"/v1/experiments/{job}/logs").text
        assert "Traceback (most recent call last)" in logs and "undefined_name" in logs
