"""Sweeps through the REST API: search-space validation (no Ray), and a real Ray Tune ASHA sweep."""

from __future__ import annotations

import pytest

from service.client import Client
from service.stack import Stack
from tests.service.conftest import Api, tiny


def sweep_body(**kw: object) -> dict:
    body = {"base": tiny(training={"epochs": 4}), "search_space": {"teleport.lr": {"loguniform": [0.01, 1]}},
            "num_samples": 2}
    body.update(kw)
    return body


def test_bad_search_spaces_are_refused_naming_the_path(api_only: Api) -> None:
    with api_only.client() as c:
        for space, needle in [({"teleport.nope": {"choice": [1]}}, "search_space.teleport.nope"),
                              ({"teleport.tau": {"choice": [0.9, 1.5]}}, "search_space.teleport.tau"),
                              ({"teleport.lr": {"loguniform": [0, 1]}}, "search_space.teleport.lr.loguniform"),
                              ({"optimizer.name": {"grid": ["sgd", "rmsprop"]}}, "search_space.optimizer.name"),
                              ({"teleport.lr": {"normal": [0, 1]}}, "search_space.teleport.lr"),
                              ({}, "search_space")]:
            r = c.post("/v1/sweeps", json=sweep_body(search_space=space))
            assert r.status_code == 422 and needle in r.json()["detail"], (space, r.text)
        r = c.post("/v1/sweeps", json=sweep_body(base=tiny(resources={"workers": 2, "gpus_per_worker": 1}),
                                                 max_concurrent_trials=2))  # 4 GPUs at once; the cluster has 2
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "max_concurrent_trials"
        ok = c.post("/v1/sweeps", json=sweep_body(max_concurrent_trials=2))
        assert ok.status_code == 201 and ok.json()["kind"] == "sweep"
        assert ok.json()["demand"]["workers"] == 2  # two trials of one worker at once
        sweep = ok.json()["id"]
        view = c.get(f"/v1/sweeps/{sweep}").json()
        assert view["job"]["state"] == "queued" and view["trials"] == [] and view["best"] is None
        assert [j["id"] for j in c.get("/v1/sweeps").json()["items"]] == [sweep]
        assert c.get("/v1/experiments").json()["items"] == []  # sweeps are listed apart
        assert c.delete(f"/v1/sweeps/{sweep}").json()["state"] == "cancelled"


@pytest.mark.slow
def test_asha_sweep_over_teleport_lr_runs_through_the_api(stack: Stack) -> None:
    base = tiny(training={"epochs": 6}, teleport={"enabled": True, "epochs": [0, 1], "batches": 1, "steps": 2},
                resources={"cpus_per_worker": 0.9})  # two trials at once on the 2-CPU head, drivers included
    body = {"base": base, "search_space": {"teleport.lr": {"grid": [0.001, 0.03, 0.3, 1.0]}},
            "scheduler": "asha", "max_concurrent_trials": 2, "metric": "train_loss", "mode": "min"}
    with Client(stack.url, stack.admin_token) as c:
        sweep = c.json("POST", "/v1/sweeps", json=body)["id"]
        events = list(c.events(sweep))  # the sweep's stream ends when the sweep does
        view = c.json("GET", f"/v1/sweeps/{sweep}")
        logs = c.request("GET", f"/v1/experiments/{sweep}/logs").text
        assert view["job"]["state"] == "succeeded", (view["job"], logs[-3000:])
        trials = view["trials"]
        assert len(trials) == 4 and {t["config"]["teleport.lr"] for t in trials} == {0.001, 0.03, 0.3, 1.0}
        assert any(t["stopped_early"] for t in trials), trials
        assert all(t["state"] in {"succeeded", "stopped early"} for t in trials)
        best = min(trials, key=lambda t: t["best"])
        assert view["best"] == best
        summary = view["job"]["summary"]
        assert summary["best_config"]["teleport.lr"] == best["config"]["teleport.lr"]
        for t in trials:  # every trial's epochs arrived, tagged, once each
            epochs = [e.data["epoch"] for e in events if e.kind == "metric" and e.data.get("trial") == t["trial"]]
            # a stopped trial may have streamed an epoch or two Tune had not seen yet when it stopped it
            assert epochs == list(range(len(epochs))) and len(epochs) >= t["epochs"] >= 1, (t, epochs)
        png = c.request("GET", f"/v1/sweeps/{sweep}/plot.png").content
        assert png[:4] == b"\x89PNG"
