"""Continue and fork over the real API and Redis, without training (no scheduler, no Ray): who may, from which
parent, from which kept epoch, with which fields changed; the child's job record, the parent's children, and
``tlab continue``/``fork``/``show``. An ended parent is a queued job cancelled at once, with checkpoint directories
written where its run keeps them (``meta.json`` says the epoch; the API reads nothing else of them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Any

import httpx

from api_schemas import keys
from service.core.store import Store
from tests.service.cli.tlab_process import TLAB
from tests.service.conftest import Api, tiny


def ended_parent(api: Api, c: httpx.Client, kept: list[int], epochs: int = 3) -> str:
    """A cancelled experiment of ``epochs`` epochs whose run kept checkpoints after epochs ``kept`` (and a diverged
    run's last one, which holds no model)."""
    job = c.post("/v1/experiments", json={"spec": tiny(training={"epochs": epochs}), "name": "base",
                                          "tags": ["lin"]}).json()["id"]
    assert c.post(f"/v1/experiments/{job}/cancel").json()["state"] == "cancelled"
    run = api.stack.home / "storage" / job
    for i, epoch in enumerate([*kept, None]):
        ckpt = run / f"checkpoint_2026-01-01_00-00-00.00000{i}"
        ckpt.mkdir(parents=True)
        (ckpt / "checkpoint.pt").write_bytes(b"weights")
        (ckpt / "meta.json").write_text(json.dumps({"epoch": epoch}))
    return job


def refused(r: httpx.Response, status: int, field: str, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["errors"][0]
    assert err["field"] == field, r.text
    assert all(w in err["message"] for w in words), r.text


def test_who_may_continue_or_fork_what(api_only: Api) -> None:
    api_only.add_user("ann")
    api_only.add_user("bob")
    with api_only.client("ann") as ann, api_only.client("bob") as bob:
        queued = ann.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
        refused(ann.post(f"/v1/experiments/{queued}/continue", json={"epochs": 2}), 409, "id", "queued",
                "once it has ended")
        bare = ann.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
        ann.post(f"/v1/experiments/{bare}/cancel")
        refused(ann.post(f"/v1/experiments/{bare}/fork", json={"from_epoch": 1}), 409, "id", "no checkpoint")
        parent = ended_parent(api_only, ann, [2, 3])
        for route, body in [("continue", {"epochs": 2}), ("fork", {"from_epoch": 2})]:
            assert bob.post(f"/v1/experiments/{parent}/{route}", json=body).status_code == 403
            assert ann.post(f"/v1/experiments/0000000000a-abcdef/{route}", json=body).status_code == 404
        sweep = ann.post("/v1/sweeps", json={"base": tiny(), "search_space": {"training.seed": {"grid": [0, 1]}}})
        refused(ann.post(f"/v1/experiments/{sweep.json()['id']}/continue", json={"epochs": 1}), 404, "id", "sweep")
        for body in [{"epochs": 0}, {"epochs": "2"}, {}, {"epochs": 2, "more": 1}]:
            assert ann.post(f"/v1/experiments/{parent}/continue", json=body).status_code == 422, body


def test_fork_from_a_kept_epoch_with_fields_that_may_change(api_only: Api) -> None:
    with api_only.client() as c:
        parent = ended_parent(api_only, c, [2, 3])
        fork = f"/v1/experiments/{parent}/fork"
        refused(c.post(fork, json={"from_epoch": 1}), 409, "from_epoch", "epoch 1 was not kept", "epochs 2, 3")
        refused(c.post(fork, json={"from_epoch": 2, "set": {"model.hidden": [64]}}), 422, "set.model.hidden",
                "model cannot change across a checkpoint")
        refused(c.post(fork, json={"from_epoch": 2, "set": {"dataset.name": "mnist"}}), 422, "set.dataset.name")
        refused(c.post(fork, json={"from_epoch": 2, "set": {"teleport.taus": 1}}), 422, "set.teleport.taus",
                "no field")
        refused(c.post(fork, json={"from_epoch": 2, "set": {"teleport.tau": 2}}), 422, "set.teleport.tau")
        refused(c.post(fork, json={"from_epoch": 3}), 422, "from_epoch", "nothing to train")
        refused(c.post(fork, json={"from_epoch": 2, "set": {"training.epochs": 100_000}}), 422,
                "spec.training.epochs")  # the service's limits apply to a child as to any submission
        r = c.post(fork, json={"from_epoch": 2, "set": {"teleport.tau": 0.99}})
        assert r.status_code == 201, r.text
        child = r.json()
        assert child["spec"]["teleport"]["tau"] == 0.99 and child["spec"]["training"]["epochs"] == 3
        assert (child["parent"], child["parent_epoch"], child["state"]) == (parent, 2, "queued")
        assert child["tags"] == ["lin"] and child["owner"] == "admin"
        start = json.loads(Store.from_url(api_only.stack.redis_url or "").r.hget(keys.job(child["id"]), "start_from"))
        assert start == {"job": parent, "epoch": 2, "checkpoint": "checkpoint_2026-01-01_00-00-00.000000"}

        r = c.post(f"/v1/experiments/{parent}/continue", json={"epochs": 2}, headers={"Idempotency-Key": "k1"})
        assert r.status_code == 201, r.text
        cont = r.json()
        assert (cont["spec"]["training"]["epochs"], cont["parent_epoch"]) == (5, 3)  # from the final checkpoint
        again = c.post(f"/v1/experiments/{parent}/continue", json={"epochs": 2}, headers={"Idempotency-Key": "k1"})
        assert again.status_code == 200 and again.json()["id"] == cont["id"]  # a retried POST: no second child
        assert c.get(f"/v1/experiments/{parent}").json()["children"] == [child["id"], cont["id"]]
    # the lineage is in Redis: a restarted API reads it back
    api_only.stack.kill("api", signal.SIGTERM)
    api_only.stack.start_service(("api",))
    with api_only.client() as c:
        assert c.get(f"/v1/experiments/{cont['id']}").json()["parent"] == parent
        assert c.get(f"/v1/experiments/{parent}").json()["children"] == [child["id"], cont["id"]]


def tlab(api: Api, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TLAB, "--url", api.url, "--token", api.stack.admin_token, *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "TLAB_HOME": "/nonexistent"})


def test_tlab_continue_fork_and_show(api_only: Api) -> None:
    with api_only.client() as c:
        parent = ended_parent(api_only, c, [1, 2])
    out = tlab(api_only, "fork", parent, "--from-epoch", "1", "--set", "teleport.tau=0.9", "--set", "optimizer.lr=0.05")
    assert out.returncode == 0, out.stderr
    child = out.stdout.split()[0]
    assert f"from {parent} after epoch 1" in out.stdout
    out = tlab(api_only, "continue", parent, "--epochs", "4")
    assert out.returncode == 0, out.stderr
    assert "6 epochs in all" in out.stdout
    shown = tlab(api_only, "show", child)
    assert f"parent    {parent} (from its checkpoint after epoch 1)" in shown.stdout, shown.stdout
    assert child in tlab(api_only, "show", parent).stdout
    spec: dict[str, Any] = json.loads(tlab(api_only, "show", child, "--json").stdout)["spec"]
    assert (spec["teleport"]["tau"], spec["optimizer"]["lr"]) == (0.9, 0.05)
    bad = tlab(api_only, "fork", parent, "--from-epoch", "1", "--set", "model.hidden=[8]")
    assert bad.returncode == 1 and "set.model.hidden: model cannot change" in bad.stderr, bad.stderr
    bad = tlab(api_only, "fork", parent, "--from-epoch", "1", "--set", "teleport.tau")
    assert bad.returncode == 1 and "PATH=VALUE" in bad.stderr, bad.stderr

