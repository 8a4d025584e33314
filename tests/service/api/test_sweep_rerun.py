"""``POST /v1/sweeps/{id}/rerun`` on the API alone (real Redis, real HTTP, no Ray): which trials may run again,
the one-line refusals naming the field, and what the accepted rerun leaves in Redis (rows, state, stream). The
rerun itself on Ray: tests/service/test_sweeps.py::test_a_failed_trial_is_rerun_inside_its_sweep."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import redis

from api_schemas import keys
from service.scheduler import preempt as preempting
from tests.service.conftest import Api, tiny

SWEEP = {"base": tiny(), "search_space": {"training.seed": {"grid": [0, 1, 2, 3]}}}


def answered(r: httpx.Response, status: int, field: str, *words: str) -> str:
    """The one-line refusal: ``status``, ``field`` named, ``words`` in the message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert [e["field"] for e in body["errors"]] == [field], body
    assert "\n" not in body["detail"] and all(w in body["detail"] for w in words), body["detail"]
    return body["detail"]


def row(trial: str, state: str, **kw: object) -> str:
    """A row as the driver's TrialTable writes it."""
    return json.dumps({"trial": trial, "config": {"training.seed": int(trial[-1])}, "state": state, "epochs": 2,
                       "last": 0.5, "best": 0.4, "stopped_early": state == "stopped early", **kw})


def ended_sweep(c: httpx.Client, r: redis.Redis, rows: dict[str, str]) -> str:
    """A sweep submitted, cancelled (queued -> cancelled at once) and given the trials table a driver would have
    left (no scheduler or Ray here)."""
    sweep = c.post("/v1/sweeps", json=SWEEP).json()["id"]
    assert c.post(f"/v1/sweeps/{sweep}/cancel").json()["state"] == "cancelled"
    r.hset(keys.trials(sweep), mapping=rows)
    return sweep


def test_rerun_refusals_name_the_field(api_only: Api) -> None:
    r = redis.Redis.from_url(api_only.stack.redis_url, decode_responses=True)
    api_only.add_user("bob")
    with api_only.client() as c, api_only.client("bob") as bob:
        queued = c.post("/v1/sweeps", json=SWEEP).json()["id"]
        answered(c.post(f"/v1/sweeps/{queued}/rerun", json={"trials": "failed"}), 409, "id", "is queued",
                 "once it has ended")
        sweep = ended_sweep(c, r, {"t_0": row("t_0", "succeeded"), "t_1": row("t_1", "failed", reason="boom"),
                                   "t_2": row("t_2", "stopped early"), "t_3": row("t_3", "running")})
        states = {t["trial"]: t["state"] for t in c.get(f"/v1/sweeps/{sweep}").json()["trials"]}
        assert states == {"t_0": "succeeded", "t_1": "failed", "t_2": "stopped early", "t_3": "cancelled"}
        rerun = f"/v1/sweeps/{sweep}/rerun"
        answered(c.post(rerun, json={"trials": ["t_9"]}), 422, "trials", "no trial 't_9'", "t_0, t_1, t_2, t_3")
        answered(c.post(rerun, json={"trials": ["t_1", "t_0"]}), 422, "trials", "trial t_0 succeeded",
                 "only a failed or cancelled trial")
        answered(c.post(rerun, json={"trials": ["t_2"]}), 422, "trials", "t_2 stopped early")
        for bad in ("all", [], ["a/b"], None):
            assert c.post(rerun, json={"trials": bad}).json()["errors"][0]["field"].startswith("trials")
        answered(bob.post(rerun, json={"trials": "failed"}), 403, "id", "another user")
        answered(c.post("/v1/sweeps/00000000000-000000/rerun", json={"trials": "failed"}), 404, "id")
        done = ended_sweep(c, r, {"t_0": row("t_0", "succeeded")})
        answered(c.post(f"/v1/sweeps/{done}/rerun", json={"trials": "failed"}), 422, "trials",
                 "no failed or cancelled trial", "succeeded")
        assert r.hget(keys.job(sweep), "state") == "cancelled" and r.hget(keys.job(done), "state") == "cancelled"


def test_an_accepted_rerun_queues_the_sweep_again_with_its_rows_marked(api_only: Api) -> None:
    r = redis.Redis.from_url(api_only.stack.redis_url, decode_responses=True)
    with api_only.client() as c:
        sweep = ended_sweep(c, r, {"t_0": row("t_0", "succeeded"), "t_1": row("t_1", "failed", reason="boom"),
                                   "t_2": row("t_2", "running"), "t_3": row("t_3", "failed", reason="bang")})
        r.hset(keys.job(sweep), mapping={"failure_reason": "2 of 4 trials failed", "summary": "{}",
                                         "attempts": "3", "preemptions": "1"})  # the ended run used 2 of 3
        r.hset(keys.job_run(sweep), "summary", "{}")
        view = c.post(f"/v1/sweeps/{sweep}/rerun", json={"trials": ["t_1", "t_1"]})
        assert view.status_code == 202, view.text
        assert preempting.failed_attempts(r.hgetall(keys.job(sweep))) == 0  # the rerun has TLAB_MAX_ATTEMPTS
        assert view.json()["id"] == sweep and view.json()["state"] == "queued"
        assert view.json()["failure_reason"] is None and view.json()["summary"] is None
        trials = {t["trial"]: t for t in c.get(f"/v1/sweeps/{sweep}").json()["trials"]}
        # t_1 as asked, t_2 (cut off by the cancel) because the sweep goes on with it; t_3 was not named
        assert {k: (t["state"], t["rerun"], t["reruns"]) for k, t in trials.items()} == {
            "t_0": ("succeeded", False, 0), "t_1": ("queued", True, 1), "t_2": ("queued", True, 1),
            "t_3": ("failed", False, 0)}
        assert trials["t_1"]["reason"] == "boom"  # until it runs again
        assert r.hget(keys.job_run(sweep), "summary") is None and sweep in r.zrange(keys.queue(), 0, -1)
        kinds = [(f["kind"], json.loads(f["data"])) for _, f in r.xrange(keys.events(sweep))]
        assert "end" not in [k for k, _ in kinds]  # a follower reading the history goes on into the rerun
        last = kinds[-1][1]
        assert last["state"] == "queued" and last["reason"] == "rerun of trials t_1, t_2 (asked by admin)"
        answered(c.post(f"/v1/sweeps/{sweep}/rerun", json={"trials": "failed"}), 409, "id", "is queued")
        # cancelled again before it ran: its queued rows are cut off; "failed" takes them and the failed t_3
        assert c.post(f"/v1/sweeps/{sweep}/cancel").json()["state"] == "cancelled"
        again = c.post(f"/v1/sweeps/{sweep}/rerun", json={"trials": "failed"})
        assert again.status_code == 202, again.text
        trials = {t["trial"]: t for t in c.get(f"/v1/sweeps/{sweep}").json()["trials"]}
        assert {k: (t["state"], t["reruns"]) for k, t in trials.items()} == {
            "t_0": ("succeeded", 0), "t_1": ("queued", 2), "t_2": ("queued", 2), "t_3": ("queued", 1)}


def test_a_rerun_counts_against_max_queued_jobs(api_only: Api) -> None:
    r = redis.Redis.from_url(api_only.stack.redis_url, decode_responses=True)
    api_only.add_user("carol", max_queued_jobs=1)
    with api_only.client("carol") as c:
        sweep = ended_sweep(c, r, {"t_1": row("t_1", "failed", reason="boom")})
        assert c.post("/v1/experiments", json={"spec": tiny()}).status_code == 201  # her one queued job
        r429 = c.post(f"/v1/sweeps/{sweep}/rerun", json={"trials": "failed"})
        answered(r429, 429, "max_queued_jobs", "a rerun queues the sweep again", "1 jobs queued")
        assert r429.headers["Retry-After"] and r.hget(keys.job(sweep), "state") == "cancelled"
        assert json.loads(r.hget(keys.trials(sweep), "t_1"))["state"] == "failed"  # nothing marked


@pytest.mark.parametrize("api_env", [{"TLAB_WEBHOOK_ALLOW": "127.0.0.1"}])  # its webhook URL is on loopback
def test_the_cli_sends_after_and_notify_with_a_sweep_or_submit_and_reruns_one(
        api_only: Api, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from api_schemas.notify import NOTIFY_STATES
    from service.cli import main
    from service.cli.after_notify import NOTIFY_STATES as CLI_STATES

    assert CLI_STATES == NOTIFY_STATES
    r = redis.Redis.from_url(api_only.stack.redis_url, decode_responses=True)
    remote = ["--url", api_only.url, "--token", api_only.tokens["admin"]]
    (tmp_path / "base.json").write_text(json.dumps(tiny()))
    (tmp_path / "space.yaml").write_text("training.seed: {grid: [0, 1]}\n")
    with api_only.client() as c:
        first = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
        sweep_cmd = [*remote, "sweep", str(tmp_path / "base.json"), "--space", str(tmp_path / "space.yaml"),
                     "--after", first, "--notify", "http://127.0.0.1:9/hook"]
        assert main([*sweep_cmd, "--notify-on", "failed,cancelled", "--notify-on", "succeeded"]) == 0
        sweep = capsys.readouterr().out.split()[0]
        job = c.get(f"/v1/sweeps/{sweep}").json()["job"]
        assert job["after"] == [first]
        assert job["notify"] == {"webhook": "http://127.0.0.1:9/hook", "on": ["failed", "cancelled", "succeeded"]}
        assert main([*remote, "submit", str(tmp_path / "base.json"), "--notify", "http://127.0.0.1:9/hook",
                     "--notify-on", "preempted"]) == 0  # the same options on submit
        job = c.get(f"/v1/experiments/{capsys.readouterr().out.split()[0]}").json()
        assert job["notify"]["on"] == ["preempted"] and job["after"] == []
        with pytest.raises(SystemExit, match="--notify-on: give --notify URL too"):
            main([*remote, "sweep", str(tmp_path / "base.json"), "--space", str(tmp_path / "space.yaml"),
                  "--notify-on", "failed"])
        with pytest.raises(SystemExit):  # argparse: exit 2, its one line naming the option
            main([*sweep_cmd, "--notify-on", "done"])
        assert "--notify-on: done: give states among succeeded, failed, cancelled, preempted" in capsys.readouterr().err

        assert main([*remote, "sweep-rerun", sweep, "--failed"]) == 1  # still queued
        assert "is queued: its trials can be rerun once it has ended" in capsys.readouterr().err
        assert c.post(f"/v1/sweeps/{sweep}/cancel").json()["state"] == "cancelled"
        r.hset(keys.trials(sweep), mapping={"t_0": row("t_0", "failed", reason="boom"), "t_1": row("t_1", "failed")})
        assert main([*remote, "sweep-rerun", sweep, "--trial", "t_1"]) == 0
        assert capsys.readouterr().out.startswith(f"{sweep}  queued")
        assert [t["rerun"] for t in c.get(f"/v1/sweeps/{sweep}").json()["trials"]] == [False, True]
