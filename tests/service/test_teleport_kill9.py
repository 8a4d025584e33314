"""A job killed with ``kill -9`` mid-run and resumed by the service takes the same teleports as the same job left
alone (float64, rtol 1e-9): the teleporter's state (the aim learned at CAP, the rank certificate's memory, ...)
travels in the job's checkpoint through a real process death, Ray's retry and the resume."""

from __future__ import annotations

import itertools
import json
import signal
from typing import Any

import pytest
import redis

from api_schemas import keys
from service.cli.client import Client
from service.stack.embedded import Stack
from tests.service.conftest import tiny
from tests.service.test_driver_death import driver_of
from tests.service.test_e2e import wait_state

KEYS = ("grad_norm_sq_before", "grad_norm_sq_after", "loss_before", "loss_after")
EPOCHS = 10
# every epoch teleports, aimed at twice each batch's own ‖∇L‖²: each aimed step teaches the teleporter's aim, so a
# teleport depends on the ones before it; batch 4 on all of digits: ~0.5 s an epoch, so the kill lands mid-run
SPEC = tiny(model={"hidden": [64, 64]},
            training={"epochs": EPOCHS, "batch_size": 4, "seed": 0, "dtype": "float64"},
            teleport={"enabled": True, "epochs": list(range(EPOCHS)), "batches": 2, "steps": 3, "batch_size": 8,
                      "rise": 1.5, "cap": None, "cap_ratio": 2.0, "budget": None})


def attempts(stack: Stack, job: str) -> list[list[dict[str, Any]]]:
    """The job's stream cut at each ``start`` record: what each attempt said, in order."""
    r = redis.Redis.from_url(stack.redis_url or "", decode_responses=True)
    out: list[list[dict[str, Any]]] = []
    for _, fields in r.xrange(keys.events(job)):
        record = json.loads(fields["data"])
        if record.get("kind") == "start":
            out.append([])
        if out:
            out[-1].append(record)
    return out


def teleports(records: list[dict[str, Any]], since: int) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "teleport" and r["epoch"] >= since]


@pytest.mark.drill
def test_a_job_killed_and_resumed_takes_the_teleports_of_the_job_left_alone(stack: Stack) -> None:
    with Client(stack.url, stack.admin_token) as c:
        whole = c.submit(SPEC, name="left alone")["id"]
        assert wait_state(c, whole, {"succeeded", "failed"}, timeout=240)["state"] == "succeeded"
        killed = c.submit(SPEC, name="killed")["id"]
        metrics = (e for e in c.events(killed) if e.kind == "metric")
        next(itertools.islice(metrics, 5, None))  # the 6th epoch: past TLAB_CHECKPOINT_EVERY_S, a checkpoint is kept
        driver_of(killed).send_signal(signal.SIGKILL)
        view = wait_state(c, killed, {"succeeded", "failed", "cancelled"}, timeout=240)
        assert view["state"] == "succeeded" and view["attempts"] == 2, view
    (alone,) = attempts(stack, whole)
    first, second = attempts(stack, killed)

    resumed = second[0]["resumed_from_epoch"]
    assert 1 <= resumed < EPOCHS, second[0]
    assert any(r["backoffs"] for r in teleports(alone, 0)), alone  # the aim was learned: later teleports depend on it
    # the stream holds each (epoch, batch) once: what the killed attempt wrote after its checkpoint stays, and the
    # resumed one's teleports land from the first epoch the killed attempt never reached, through the last
    got = teleports(second, resumed)
    assert got and sorted({r["epoch"] for r in got}) == list(range(got[0]["epoch"], EPOCHS)), got
    alone_at = {(r["epoch"], r["batch"]): r for r in teleports(alone, 0)}
    want = [alone_at[r["epoch"], r["batch"]] for r in got]
    assert [(r["epoch"], r["batch"], r["steps"], r["backoffs"], r["stop_reason"]) for r in got] == \
        [(r["epoch"], r["batch"], r["steps"], r["backoffs"], r["stop_reason"]) for r in want]
    for x, y in zip(got, want, strict=True):
        for key in KEYS:
            assert x[key] == pytest.approx(y[key], rel=1e-9), (x["epoch"], x["batch"], key)
    # and what the killed attempt took before its checkpoint is what the job left alone took there
    before = [(r["epoch"], r["batch"], r["steps"]) for r in teleports(first, 0) if r["epoch"] < resumed]
    assert before == [(r["epoch"], r["batch"], r["steps"]) for r in teleports(alone, 0) if r["epoch"] < resumed]
