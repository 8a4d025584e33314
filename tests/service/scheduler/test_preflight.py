"""Preflights on the real stack (real Redis, Ray, HTTP): a dry run of a good and a broken package (200 with the
result, 422 with the one line; nothing queued), a factory with a NameError failing in its preflight with no gang
started, a good package passing and training, and a preflight in flight found again by a restarted scheduler,
then stopped by a cancel."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from service.cli.client import ApiError, Client
from service.cli.code_zip import upload
from service.cli.jobs import preflight_lines
from service.stack.embedded import Stack, release_scheduler_lock
from tests.service.conftest import ray_holders, ray_rest, ray_state, wait_for
from tests.service.test_code_packages import wait_end

pytestmark = pytest.mark.slow
MODELS = '''
import time

from torch import nn


def mlp(hidden=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def broken(hidden=16):
    return undefined_name  # line 12


def slow(hidden=16):
    time.sleep(60)
'''
BROKEN = "pfsvc/models.py:12: NameError: name 'undefined_name' is not defined"


def package(c: Client, tmp_path: Path) -> str:
    root = tmp_path / "code"
    (root / "pfsvc").mkdir(parents=True)
    (root / "pfsvc" / "__init__.py").write_text("")
    (root / "pfsvc" / "models.py").write_text(textwrap.dedent(MODELS))
    return str(upload(c, str(root))["package"])


def spec(package: str, factory: str = "mlp") -> dict:
    return {"dataset": {"name": "digits"}, "model": {"kind": "custom", "factory": f"pfsvc.models:{factory}"},
            "training": {"epochs": 1, "batch_size": 64},
            "teleport": {"epochs": [0], "batches": 1, "batch_size": 16, "steps": 1}, "code": {"package": package}}


def test_dry_runs_and_a_broken_factory_failing_in_its_preflight_without_a_gang(stack: Stack, tmp_path: Path) -> None:
    with Client(stack.url, stack.admin_token) as c:
        pkg = package(c, tmp_path)
        dry = c.json("POST", "/v1/experiments", params={"dry_run": "true"}, json={"spec": spec(pkg)})
        assert dry["preflight"]["state"] == "passed" and dry["preflight"]["params"] == 64 * 16 + 16 + 16 * 10 + 10
        assert dry["preflight"]["layers"] and dry["fits_ever"]
        with pytest.raises(ApiError) as bad:
            c.json("POST", "/v1/experiments", params={"dry_run": "true"}, json={"spec": spec(pkg, "broken")})
        assert bad.value.status == 422 and str(bad.value).endswith(f"spec: preflight failed: {BROKEN}")
        assert c.list() == []  # a dry run queues nothing
        job = c.submit(spec(pkg, "broken"))["id"]
        view = wait_end(c, job, timeout=60)
        assert view["state"] == "failed" and view["failure_reason"] == BROKEN
        assert view["preflight"] == {**view["preflight"], "state": "failed", "error": BROKEN}
        assert view["attempts"] == 0 and view["ray_job_id"] is None  # the gang's Ray job was never submitted
        log = c.logs(job, rank="preflight", attempt=1)
        assert "Traceback (most recent call last)" in log and "undefined_name" in log


def test_a_good_package_passes_its_preflight_then_trains(stack: Stack, tmp_path: Path) -> None:
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(spec(package(c, tmp_path)))["id"]
        view = wait_end(c, job, timeout=90)
        assert view["state"] == "succeeded", view.get("failure_reason")
        pf = view["preflight"]
        assert pf["state"] == "passed" and pf["train_size"] > 0 and pf["sample_shape"] == [1, 8, 8]
        assert pf["teleport"] == "nullspace" and pf["free_directions"] == sum(x["free"] for x in pf["layers"])
        seen = f"‖∇L‖² {pf['grad_norm_sq']:.3g} at the model's first weights"  # what teleport will do, before the gang
        assert pf["step_advice"].startswith(seen) and f"  teleport step: {pf['step_advice']}" in preflight_lines(pf)
        assert pf["wall_seconds"] >= pf["seconds"]  # what the job waited: Ray's start and the imports too
        assert view["attempts"] == 1
        messages = [e.data.get("message", "") for e in c.events(job, reconnect=False) if e.kind == "log"]
        assert any(m.startswith("preflight passed") for m in messages)


@pytest.mark.drill
def test_a_preflight_in_flight_survives_a_scheduler_restart_and_a_cancel_stops_it(stack: Stack,
                                                                                  tmp_path: Path) -> None:
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit({**spec(package(c, tmp_path), "slow"), "resources": {"memory_gb": 1}})["id"]
        wait_for(lambda: c.get(job)["preflight"]["state"] == "running" and running_preflight(stack, job), 30)
        # the preflight's Ray job reserves the job's memory (its supervisor holds the preflight to it)
        wait_for(lambda: preflight_memory(stack, job) == 2**30, 30)
        stack.kill("scheduler")
        release_scheduler_lock(stack.redis_url or "")
        stack.restart("scheduler")
        wait_for(lambda: c.get(job)["pending_reason"].startswith("preflight running ("), 30)  # found again
        assert [j["id"] for j in ray_holders(stack)["ray_jobs"] if j["tlab_job"] == job] == [f"tlab-{job}-preflight"]
        c.cancel(job)
        assert c.get(job)["state"] == "cancelled"
        wait_for(lambda: not running_preflight(stack, job), 30)
        view = c.get(job)
        assert view["attempts"] == 0 and view["preflight"]["state"] == "stopped"


def preflight_memory(stack: Stack, job: str) -> float | None:
    """What the job's preflight (its Ray job's JobSupervisor actor, which Ray names after the submission id)
    reserves of Ray's memory; None while it is not alive."""
    name = f"_ray_internal_job_actor_tlab-{job}-preflight"
    with ray_rest(stack) as http:
        held = [float((a.get("required_resources") or {}).get("memory") or 0) for a in ray_state(http, "actors")
                if a["state"] == "ALIVE" and a.get("name") == name]
    return held[0] if held else None


def running_preflight(stack: Stack, job: str) -> bool:
    return any(j["id"] == f"tlab-{job}-preflight" for j in ray_holders(stack)["ray_jobs"])


def test_a_preflight_without_room_for_its_memory_runs_unreserved(stack: Stack, tmp_path: Path) -> None:
    """Where no node has the job's memory free (another job reserved it), the preflight does not wait for it (a
    stream of smaller jobs could keep taking it): it runs without a reservation, held to memory_gb by its supervisor."""
    with Client(stack.url, stack.admin_token) as c:
        wait_for(lambda: c.json("GET", "/v1/cluster")["nodes"], 30)
        total = c.json("GET", "/v1/cluster")["nodes"][0]["memory_gb_total"]
        hog = c.submit({"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [16]},
                        "training": {"epochs": 100_000}, "teleport": {"enabled": False},
                        "resources": {"memory_gb": round(total - 0.5, 2)}})["id"]
        wait_for(lambda: c.get(hog)["state"] == "running", 60)
        job = c.submit({**spec(package(c, tmp_path), "slow"), "resources": {"memory_gb": 1}})["id"]
        wait_for(lambda: (c.get(job).get("preflight") or {}).get("state") == "running"
                 and running_preflight(stack, job), 60)
        wait_for(lambda: preflight_memory(stack, job) is not None, 30)
        assert preflight_memory(stack, job) == 0.0  # no reservation: it would have waited in Ray
        c.cancel(job)
        c.cancel(hog)


def test_tlab_show_says_what_the_job_waited_for_its_preflight_and_its_own_work() -> None:
    pf = {"state": "passed", "seconds": 0.04, "wall_seconds": 2.63}
    assert preflight_lines(pf)[0] == "preflight passed in 2.6 s (0.0 s of it its own work)"
    assert preflight_lines({"state": "failed", "seconds": 0.5, "error": "boom"})[0] == "preflight failed in 0.5 s: boom"
    assert preflight_lines({"state": "failed", "error": "no verdict"})[0] == "preflight failed: no verdict"
