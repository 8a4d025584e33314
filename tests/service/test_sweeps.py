"""Sweeps through the REST API: search-space validation (no Ray), then each searcher and scheduler on a real Ray Tune
sweep (ASHA, Optuna, PBT, ``tlab compare``'s study), a sweep cancelled, a failed trial rerun: those are marked
``sweeps`` and run in ``make test-sweeps`` (each takes the whole head for several trials at once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from api_schemas import keys
from service.cli.client import Client
from service.core.settings import Settings
from service.launch.job_acl import JobAcl
from service.stack.embedded import Stack
from tests.service.conftest import Api, ray_holders, tiny, wait_for, wait_ray_idle


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
        r = c.post("/v1/sweeps", json=sweep_body(searcher="optuna", search_space={"training.seed": {"grid": [0, 1]}}))
        assert r.status_code == 422 and "search_space.training.seed: the optuna searcher" in r.json()["detail"], r.text
        for kw, needle in [({"searcher": "optuna"}, "searcher: pbt explores"),
                           ({"search_space": {"training.seed": {"grid": [0, 1]}}}, "search_space: scheduler pbt needs"),
                           ({"search_space": {"model.hidden": {"choice": [[8], [16]]}}},
                            "search_space.model.hidden: pbt can only mutate"),
                           ({"search_space": {"optimizer.name": {"choice": ["sgd", "adam"]}}},
                            "search_space.optimizer.name: pbt can only mutate"),
                           ({"perturbation_interval": 4}, "perturbation_interval: 4 leaves no room")]:
            r = c.post("/v1/sweeps", json=sweep_body(scheduler="pbt", **kw))
            assert r.status_code == 422 and needle in r.json()["detail"], (kw, r.text)
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
        assert c.post(f"/v1/sweeps/{sweep}/cancel").json()["state"] == "cancelled"


@pytest.mark.slow
@pytest.mark.sweeps
def test_asha_sweep_over_teleport_lr_runs_through_the_api(stack: Stack) -> None:
    # teleport.budget off: each trial teleports as its spec says, however loaded the machine (a budget cuts by time)
    base = tiny(training={"epochs": 6}, resources={"cpus_per_worker": 0.9},  # two trials at once on the 2-CPU head
                teleport={"enabled": True, "epochs": [0, 1], "batches": 1, "steps": 2, "budget": None})
    body = {"base": base, "search_space": {"teleport.lr": {"grid": [0.001, 0.03, 0.3, 1.0]}},
            "scheduler": "asha", "max_concurrent_trials": 2, "metric": "train_loss", "mode": "min"}
    wait_ray_idle(stack)  # its trials run two at a time on the whole head
    with Client(stack.url, stack.admin_token) as c:
        sweep = c.json("POST", "/v1/sweeps", json=body)["id"]
        events = list(c.events(sweep))  # the sweep's stream ends when the sweep does
        view = c.json("GET", f"/v1/sweeps/{sweep}")
        logs = c.request("GET", f"/v1/experiments/{sweep}/logs").text
        rows = [(t["config"], t["state"], t.get("reason")) for t in view["trials"]]
        assert view["job"]["state"] == "succeeded", (rows, view["job"]["failure_reason"], logs[-3000:])
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
    # once the scheduler has settled the ended sweep (its size counted), each trial keeps its newest checkpoint only
    r = redis.Redis.from_url(stack.redis_url or "", decode_responses=True)
    wait_for(lambda: bool(r.hget(keys.job(sweep), "storage_bytes")), 60, "the scheduler never settled the ended sweep")
    kept = {t.name: sorted(p.name for p in t.glob("checkpoint_*"))
            for t in (stack.home / "storage" / f"sweep-{sweep}").iterdir() if t.is_dir()}
    assert len(kept) == 4 and all(len(names) == 1 for names in kept.values()), kept


def colour_pixels(png: bytes) -> dict[str, int]:
    """Pixels of each group's mean line (matplotlib's C0 blue, C1 orange) and of its shaded ± std band
    (the same hue, light)."""
    import io

    import numpy as np
    from matplotlib.image import imread

    img = (imread(io.BytesIO(png), format="png")[..., :3] * 255).astype(int)
    r, g, b = img[..., 0], img[..., 1], img[..., 2]

    def near(rgb: tuple[int, int, int], tol: int = 30) -> int:
        return int(np.sum((abs(r - rgb[0]) < tol) & (abs(g - rgb[1]) < tol) & (abs(b - rgb[2]) < tol)))

    light = (r > 150) & (g > 150) & (b > 150) & ~((r > 245) & (g > 245) & (b > 245))  # tinted, not white
    return {"blue line": near((31, 119, 180)), "orange line": near((255, 127, 14)),
            "blue band": int(np.sum(light & (b - r > 20))), "orange band": int(np.sum(light & (r - b > 30)))}


@pytest.mark.slow
@pytest.mark.sweeps
def test_tlab_compare_runs_the_study_as_a_sweep_with_a_table_and_two_bands(
        stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tlab compare --seeds 2` through the service: a teleport on/off × seed sweep, the study table (mean ±
    std over seeds), and the band plot (two groups, each a mean line and a shaded band)."""
    import json

    from service.cli import main

    # the digits demo (MLP [256, 256], SGD 0.05), where teleport visibly changes the first epochs
    out = tmp_path / "study"
    argv = ["--url", stack.url, "--token", stack.admin_token, "compare", "--preset", "digits/teleport",
            "--set", "training.epochs=3", "--set", "training.target_loss=0.5", "--set", "teleport.epochs=[0, 1]",
            "--set", "teleport.batches=8", "--set", "resources.cpus_per_worker=0.9", "--seeds", "2",
            "--max-concurrent", "2", "--out", str(out), "--no-progress"]
    wait_ray_idle(stack)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    study = json.loads((out / "compare.json").read_text())
    view = json.loads((out / "sweep.json").read_text())
    assert view["job"]["state"] == "succeeded" and len(view["trials"]) == 4
    assert all(t["state"] == "succeeded" and t["epochs"] == 3 for t in view["trials"])
    groups = {g["label"]: g for g in study["groups"]}
    assert set(groups) == {"teleport.enabled=True", "teleport.enabled=False"} and study["seeds"] == 2
    for label, g in groups.items():
        assert len(g["trials"]) == 2 and g["stats"]["final_train_loss"]["n"] == 2, g
        losses = [r["final_train_loss"] for r in g["runs"]]
        assert abs(g["stats"]["final_train_loss"]["mean"] - sum(losses) / 2) < 1e-9
        assert all(r["epochs"] == 3 for r in g["runs"])
        shares = [r["teleport_share"] for r in g["runs"]]
        assert all(s > 0 for s in shares) if label.endswith("True") else all(s == 0 for s in shares), shares
        assert label in printed  # the table: one row per group
    assert "epochs to 0.5" in printed and "± " in printed and "(the study took " in printed
    px = colour_pixels((out / "compare.png").read_bytes())
    # a band can be thin: seeds that barely differ give a small std
    assert px["blue line"] > 300 and px["orange line"] > 300, px
    assert px["blue band"] > 100 and px["orange band"] > 100, px


def test_colour_check_tells_one_band_from_two() -> None:
    import io

    from plots.curves import plot_bands

    def recs(scale: float, seed: int) -> list[dict]:
        return [{"kind": "epoch", "epoch": e, "train_loss": scale * (1 + 0.2 * seed) / (e + 1),
                 "test_loss": scale * (1.1 + 0.1 * seed) / (e + 1)} for e in range(3)]

    one, two = io.BytesIO(), io.BytesIO()
    plot_bands({"a": [recs(1, 0), recs(1, 1)]}, one, fmt="png")
    plot_bands({"a": [recs(1, 0), recs(1, 1)], "b": [recs(2, 0), recs(2, 1)]}, two, fmt="png")
    single, double = colour_pixels(one.getvalue()), colour_pixels(two.getvalue())
    assert single["orange line"] < 50 and single["orange band"] < 50 and single["blue band"] > 1000
    assert double["orange line"] > 300 and double["orange band"] > 1000


@pytest.mark.slow
@pytest.mark.sweeps
def test_cancelling_a_sweep_stops_every_trial(stack: Stack) -> None:
    import time

    import redis

    from api_schemas import keys

    # tiny epochs take ~20 ms, and the second trial's workers need ~10 s to start: the first trial must
    # not be able to finish meanwhile
    base = tiny(training={"epochs": 100_000}, resources={"cpus_per_worker": 0.9})
    body = {"base": base, "search_space": {"training.seed": {"grid": [0, 1, 2, 3]}}, "max_concurrent_trials": 2}
    wait_ray_idle(stack)  # the two trials take the whole head
    with Client(stack.url, stack.admin_token) as c:
        sweep = c.json("POST", "/v1/sweeps", json=body)["id"]
        try:
            deadline = time.monotonic() + 180
            while True:  # until two trials are training
                trials = c.json("GET", f"/v1/sweeps/{sweep}")["trials"]
                running = {t["trial"] for t in trials if t["epochs"] > 0}
                if len(running) == 2:
                    break
                assert time.monotonic() < deadline, f"two trials never trained at once: {trials} {ray_holders(stack)}"
                time.sleep(0.5)
            # max_concurrent_trials holds: only two trials were ever started
            assert sorted(t["trial"] for t in trials) == sorted(running), trials
            # and Ray holds what the scheduler counts, 2 x 0.9 CPU (the trials' drivers take none): once the
            # head's usage report (every ~5 s) has caught up, 0.2 CPU is free by both counts
            wait_for(lambda: c.json("GET", "/v1/cluster")["cpus_free"] == pytest.approx(0.2), 30,
                     f"the free CPUs never came to 0.2: {c.json('GET', '/v1/cluster')} {ray_holders(stack)}")
            assert c.json("POST", f"/v1/sweeps/{sweep}/cancel")["state"] in {"starting", "running"}
            events = list(c.events(sweep))
            assert events[-1].data["state"] == "cancelled"
            r = redis.Redis.from_url(stack.redis_url or "")
            length = r.xlen(keys.events(sweep))
            time.sleep(5.0)
            assert r.xlen(keys.events(sweep)) == length  # no trial is still training and reporting
            trials = c.json("GET", f"/v1/sweeps/{sweep}")["trials"]
            assert all(t["epochs"] < 100_000 and t["state"] != "succeeded" for t in trials) and len(trials) <= 4, trials
        finally:  # a failed check must not leave 100_000 epochs holding the head for the tests after this one
            c.http.request("POST", f"/v1/sweeps/{sweep}/cancel")  # a no-op (409) once it has ended
    wait_ray_idle(stack)  # and the cancel gave every CPU back


@pytest.mark.slow
@pytest.mark.drill
def test_a_sweep_cut_off_by_a_stack_restart_resumes_its_trials(tmp_path: Path) -> None:
    """Stop the whole stack (Redis, Ray, API, scheduler) while two trials train, start it again with the
    same home: the sweep is queued again, Tune restores its saved state, the same trials carry on from
    their checkpoints, and every trial's epochs are in the stream exactly once."""
    from service.cli.client import Event

    home = tmp_path / "tlab"
    env = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}
    epochs = 150  # one step each: the first trial must still be training when the second one is up (it was at
    # 3-29 epochs on 2 idle cores)
    body = {"base": tiny(training={"epochs": epochs, "max_steps_per_epoch": 1}, resources={"cpus_per_worker": 0.9}),
            "search_space": {"training.seed": {"grid": [0, 1]}}, "max_concurrent_trials": 2}
    with Stack(home, num_cpus=2, tick_s=0.2, extra_env=env) as s1, Client(s1.url, s1.admin_token) as c:
        sweep = c.json("POST", "/v1/sweeps", json=body)["id"]
        seen: dict[str, int] = {}
        for event in c.events(sweep):  # until both trials are past their third epoch
            if event.kind == "metric":
                seen[event.data["trial"]] = seen.get(event.data["trial"], 0) + 1
                if len(seen) == 2 and min(seen.values()) >= 3:
                    break
        before = {t["trial"]: t for t in c.json("GET", f"/v1/sweeps/{sweep}")["trials"]}
        assert set(before) == set(seen) and all(t["epochs"] < epochs for t in before.values()), before
    with Stack(home, num_cpus=2, tick_s=0.2, extra_env=env) as s2, Client(s2.url, s2.admin_token) as c:
        events: list[Event] = list(c.events(sweep))
        view = c.json("GET", f"/v1/sweeps/{sweep}")
        job = view["job"]
        why = [(t["trial"], t["state"], t["epochs"], t.get("reason")) for t in view["trials"]]
        said = [e.data.get("message") for e in events if e.kind == "log"]
        assert job["state"] == "succeeded" and job["attempts"] == 2, (  # a failure says each trial's why in full
            f"sweep {job['state']} after {job['attempts']} attempts ({job.get('failure_reason')}); trials {why}; "
            f"logs {said}")
        after = {t["trial"]: t for t in view["trials"]}
        assert set(after) == set(before), (before, after)  # the same trials, not a new sweep
        assert all(t["state"] == "succeeded" and t["epochs"] == epochs for t in after.values()), after
        for trial in after:
            got = [e.data["epoch"] for e in events if e.kind == "metric" and e.data.get("trial") == trial]
            assert got == list(range(epochs)), (trial, got[:10], len(got))
        logs = [e.data.get("message", "") for e in events if e.kind == "log"]
        assert any("resuming the sweep from Tune's state" in m for m in logs), logs
        # Tune's saved state (tuner.pkl: the trials table's callback) is on the storage every job's code reads: no
        # attempt's Redis password in it or in any file there (service/launch/job_acl.py, workers/job/ticket.py)
        acl = JobAcl(redis.Redis.from_url(s2.redis_url or ""), Settings(redis_url=s2.redis_url or ""))
        assert (home / "storage" / f"sweep-{job['id']}" / "tuner.pkl").exists()
        words = [acl.password(f"tlab-{job['id']}-{n}").encode() for n in (1, 2)]
        assert not [p for p in (home / "storage").rglob("*") if p.is_file() and any(w in p.read_bytes() for w in words)]


@pytest.mark.slow
@pytest.mark.sweeps
def test_optuna_searcher_samples_the_space(stack: Stack) -> None:
    body = {"base": tiny(training={"epochs": 3}, resources={"cpus_per_worker": 0.9}), "searcher": "optuna", "seed": 7,
            "search_space": {"teleport.lr": {"loguniform": [0.01, 1]}, "optimizer.name": {"choice": ["sgd", "adam"]}},
            "num_samples": 2, "max_concurrent_trials": 2}  # one wave of trials on the 2-CPU head
    wait_ray_idle(stack)  # its trials run two at a time on the whole head
    with Client(stack.url, stack.admin_token) as c:
        sweep = c.json("POST", "/v1/sweeps", json=body)["id"]
        list(c.events(sweep))
        view = c.json("GET", f"/v1/sweeps/{sweep}")
        assert view["job"]["state"] == "succeeded", view["job"]
        trials = view["trials"]
        assert len(trials) == 2 and all(t["state"] == "succeeded" and t["epochs"] == 3 for t in trials), trials
        lrs = [t["config"]["teleport.lr"] for t in trials]
        assert len(set(lrs)) == 2 and all(0.01 <= lr <= 1 for lr in lrs), lrs
        assert {t["config"]["optimizer.name"] for t in trials} <= {"sgd", "adam"}
        assert view["best"]["trial"] == view["job"]["summary"]["best_trial"]


@pytest.mark.slow
@pytest.mark.sweeps
def test_pbt_moves_the_bottom_trial_onto_the_top_trials_checkpoint(stack: Stack) -> None:
    # two trials, one whose optimizer barely moves (lr 1e-5): at a perturbation round it is the bottom
    # trial, so PBT copies the other's checkpoint and config (the grid value too) and goes on from there
    body = {"base": tiny(training={"epochs": 6}, teleport={"enabled": True, "epochs": [0, 2, 4], "batches": 1},
                         resources={"cpus_per_worker": 0.9}),
            "scheduler": "pbt", "perturbation_interval": 2, "seed": 3, "max_concurrent_trials": 2,
            "search_space": {"optimizer.lr": {"grid": [1e-5, 0.3]}, "teleport.lr": {"loguniform": [0.01, 0.5]}}}
    wait_ray_idle(stack)  # its trials run two at a time on the whole head
    with Client(stack.url, stack.admin_token) as c:
        sweep = c.json("POST", "/v1/sweeps", json=body)["id"]
        events = list(c.events(sweep))
        view = c.json("GET", f"/v1/sweeps/{sweep}")
        logs = c.request("GET", f"/v1/experiments/{sweep}/logs").text
    assert view["job"]["state"] == "succeeded", (view["job"], logs[-4000:])
    trials = {t["trial"]: t for t in view["trials"]}
    starts_seen = [(e.data["trial"], e.data["resumed_from_epoch"]) for e in events if e.data.get("kind") == "start"]
    rows = json.dumps(trials, indent=1) + f"\nstarts {starts_seen}\n" + logs[-8000:]  # whole: pytest shortens a dict
    assert len(trials) == 2 and all(t["state"] == "succeeded" and t["epochs"] == 6 for t in trials.values()), rows
    assert all(t["config"]["optimizer.lr"] == 0.3 for t in trials.values()), rows  # copied with the checkpoint
    epochs: dict[str, dict[int, list[float]]] = {}
    starts: dict[str, list[int]] = {}
    for e in events:
        if e.kind == "metric":
            epochs.setdefault(e.data["trial"], {}).setdefault(e.data["epoch"], []).append(e.data["train_loss"])
        if e.data.get("kind") == "start":
            starts.setdefault(e.data["trial"], []).append(e.data["resumed_from_epoch"])
    for tid in trials:
        assert sorted(epochs[tid]) == list(range(6)), epochs  # every epoch of every trial arrived, once
        assert all(len(v) == 1 for v in epochs[tid].values()), epochs
        assert starts[tid][0] == 0 and starts[tid] == sorted(starts[tid]) and starts[tid][-1] == 4, starts
    # the moved trial went on from the top trial's weights: after the move its loss is far below its own
    # slow start, at the level the lr-0.3 trial had reached
    slow = max(trials, key=lambda t: epochs[t][1][0])  # the lr-1e-5 trial, before the first round
    other = next(t for t in trials if t != slow)
    assert trials[slow]["perturbed"] >= 1, trials  # it was the bottom trial at epoch 2 and was moved
    # rounds at epochs 2 and 4 only: a move at the end (epoch 6) would relabel a finished trial's row with a
    # config its results never trained under, and restart it for nothing
    assert all(t["perturbed"] <= 2 for t in trials.values()), trials
    assert epochs[slow][5][0] < 0.5 * epochs[slow][0][0], epochs[slow]
    assert epochs[slow][5][0] < 2 * epochs[other][5][0], (epochs[slow], epochs[other])
    # storage keeps at most one training run per trial (the last interval's) besides Tune's copies, and
    # no leftover copy of an exploited checkpoint
    storage = stack.home / "storage"
    for tid in trials:
        assert len(list(storage.glob(f"{sweep}-{tid}-*"))) <= 1, sorted(p.name for p in storage.iterdir())
    assert not any((storage / f"pbt-{sweep}").glob("*/*"))


FLAKY = '''"""The example's own loop, failing at epoch ``fail_at`` until the file ``fixed`` exists."""
import os

from own_loop.loop import train as example_train


class FailAt:
    def __init__(self, ctx):
        self.ctx = ctx

    def __getattr__(self, name):
        return getattr(self.ctx, name)

    def epochs(self):
        for epoch in self.ctx.epochs():
            if epoch == self.ctx.args["fail_at"] and not os.path.exists(self.ctx.args["fixed"]):
                raise RuntimeError(f"epoch {epoch}: no {os.path.basename(self.ctx.args['fixed'])} yet")
            yield epoch


def train(ctx):
    example_train(FailAt(ctx))
'''


@pytest.mark.slow
@pytest.mark.sweeps
# the cause is "fixed" by a file the test writes on the host, which a sandboxed trial cannot see (the
# sandbox is held to that in tests/service/test_sandbox.py); here the trials run as plain children
@pytest.mark.parametrize("stack_env", [{"TLAB_SANDBOX": "off"}])
def test_a_failed_trial_is_rerun_inside_its_sweep(stack: Stack, tmp_path: Path) -> None:
    """One trial of two fails at epoch 1 (after epoch 0's checkpoint). With the cause fixed, ``failed`` reruns it
    from that checkpoint: epochs 1 and 2, so each epoch is in the stream once; the sweep keeps its id, the failed
    row updates in place, the other trial is untouched, and the summary is recomputed over both (one rerun: each
    costs a sweep's start; the refusals and the marks are tests/service/api/test_sweep_rerun.py's, without Ray)."""
    import shutil

    from service.cli.code_zip import upload

    package = tmp_path / "pkg"
    shutil.copytree(Path(__file__).resolve().parents[2] / "examples" / "own_loop" / "own_loop", package / "own_loop",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (package / "flaky.py").write_text(FLAKY)
    fixed = tmp_path / "fixed"
    with Client(stack.url, stack.admin_token) as c:
        base = {"training": {"entrypoint": "flaky:train", "epochs": 3, "batch_size": 64,
                             "entrypoint_args": {"width": 8, "samples": 128, "fail_at": 99, "fixed": str(fixed)}},
                "teleport": {"enabled": False}, "code": {"package": upload(c, str(package))["package"]}}
        body = {"base": base, "search_space": {"training.entrypoint_args.fail_at": {"grid": [99, 1]}}}
        sweep = c.json("POST", "/v1/sweeps", json=body)["id"]

        def ended() -> tuple[dict, dict[str, dict]]:
            list(c.events(sweep))  # the stream ends when the sweep does
            view = c.json("GET", f"/v1/sweeps/{sweep}")
            return view, {t["config"]["training.entrypoint_args.fail_at"]: t for t in view["trials"]}

        view, trials = ended()
        bad, good = trials[1], trials[99]
        assert view["job"]["state"] == "failed" and bad["state"] == "failed" and good["state"] == "succeeded", view
        reason = bad["reason"]
        assert reason.startswith("flaky.py:") and reason.endswith("RuntimeError: epoch 1: no fixed yet"), reason
        assert f"{bad['trial']}: {reason}" in view["job"]["failure_reason"], view["job"]
        trial_log = c.logs(sweep, rank=f"trial-{bad['trial']}")  # the trial's own output, kept with the sweep's
        assert "RuntimeError: epoch 1: no fixed yet" in trial_log and "Traceback" in trial_log, trial_log[-800:]

        fixed.write_text("")
        assert c.json("POST", f"/v1/sweeps/{sweep}/rerun", json={"trials": "failed"})["state"] == "queued"
        view, trials = ended()
        events = list(c.events(sweep))
    job = view["job"]
    assert job["state"] == "succeeded" and job["id"] == sweep and job["attempts"] == 2, view
    assert job["failure_reason"] is None
    assert (trials[1]["state"], trials[1]["epochs"], trials[1]["reruns"]) == ("succeeded", 3, 1), trials[1]
    assert trials[1].get("reason") is None and trials[99] == good
    assert job["summary"]["trials"] == 2 and job["summary"]["errors"] == 0
    assert view["best"]["trial"] == job["summary"]["best_trial"]
    for t in (good, bad):
        got = [e.data["epoch"] for e in events if e.kind == "metric" and e.data.get("trial") == t["trial"]]
        assert got == [0, 1, 2], (t["trial"], got)  # the rerun went on from its checkpoint: no epoch twice
    starts = [e.data["resumed_from_epoch"] for e in events if e.data.get("kind") == "start"
              and e.data.get("trial") == bad["trial"]]
    assert starts[0] == 0 and starts[-1] == 1, starts
    assert [e.data["state"] for e in events if e.kind == "end"] == ["succeeded"]
