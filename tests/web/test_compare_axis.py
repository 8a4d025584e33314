"""The compare page's x-axis switch in a real chromium: epochs trained | wall-clock seconds, teleports marked on both.

Epoch and teleport events are written by the workers' own Redis sink into two queued jobs' streams (what rank 0
does while a job runs), so the page reads them from the real /metrics route without starting Ray.
"""

from __future__ import annotations

import json
from typing import Any

import redis
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from api_schemas import keys
from tests.service.conftest import Api, tiny
from workers.job.redis_sink import RedisSink
from workers.train.shared import summarize

TARGET = 0.3


def events(scale: float, per_epoch: float, teleports: dict[int, float], epochs: range) -> list[dict[str, Any]]:
    """A run's records as workers/train/loop.py writes them: seconds are cumulative, each teleport's time included."""
    out: list[dict[str, Any]] = []
    t = tele = 0.0
    for e in range(epochs.stop):
        if e in teleports:
            out.append({"kind": "teleport", "epoch": e, "batch": 0, "method": "nullspace", "seconds": teleports[e],
                        "grad_norm_sq_before": 1.0, "grad_norm_sq_after": 2.0, "loss_before": 1.0, "loss_after": 1.0})
            t, tele = t + teleports[e], tele + teleports[e]
        t += per_epoch * (1 + 0.07 * e)
        out.append({"kind": "epoch", "epoch": e, "train_loss": scale / (e + 1), "test_loss": scale / (e + 1.5),
                    "seconds": round(t, 6), "teleport_seconds": round(tele, 6)})
    return [r for r in out if r["epoch"] in epochs]


def emit(url: str, job: str, records: list[dict[str, Any]]) -> None:
    sink = RedisSink(url, job)
    for r in records:
        sink.emit(r)
    sink.close()


def epoch_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "epoch"]


def expected(runs: list[list[dict[str, Any]]], axis: str, metric: str) -> list[list[float | None]]:
    """uPlot's data: the union of the runs' x values, sorted, then one y column per run (null where it has none)."""
    x = (lambda r: r["epoch"] + 1) if axis == "epoch" else (lambda r: r["seconds"])
    xs = sorted({x(r) for recs in runs for r in epoch_rows(recs)})
    cols = [{x(r): r[metric] for r in epoch_rows(recs)} for recs in runs]
    return [xs, *[[c.get(v) for v in xs] for c in cols]]


def teleport_marks(records: list[dict[str, Any]], axis: str) -> list[float]:
    """Epochs trained before each teleport, or the seconds at which the epoch before it ended."""
    ends = {r["epoch"]: r["seconds"] for r in epoch_rows(records)}
    tele = sorted({r["epoch"] for r in records if r["kind"] == "teleport"})
    return [float(e) if axis == "epoch" else (ends[e - 1] if e else 0.0) for e in tele]


CHART = """() => { const u = window.tlab.charts.compare;
  return u ? { data: u.data, x: u.series[0].label, marks: u.tlabMarks().map((m) => m.x) } : null; }"""

SAME = """(want) => { const d = window.tlab.charts.compare?.data;
  return !!d && d.length === want.length && d.every((col, i) => col.length === want[i].length
    && col.every((v, j) => v === want[i][j])); }"""


def wait_for_data(page: Any, data: list[list[float | None]]) -> dict[str, Any]:
    """The chart once its data equals ``data`` (the page refreshes every few seconds)."""
    try:
        page.wait_for_function(SAME, arg=data)
    except PlaywrightTimeout:
        raise AssertionError(f"chart data {page.evaluate(CHART)} != {data}") from None
    return page.evaluate(CHART)


def test_the_compare_chart_switches_between_epochs_and_seconds(api_only: Api, tab_factory: Any) -> None:
    with api_only.client() as c:
        ids = [c.post("/v1/experiments", json={"spec": tiny(), "name": n}).json()["id"] for n in ("tele", "plain")]
    url = api_only.stack.redis_url or ""
    full = [events(1.0, 0.9, {0: 1.3, 3: 0.6}, range(8)), events(1.4, 0.6, {}, range(6))]
    runs = [[r for r in full[0] if r["epoch"] < 6], full[1]]  # the teleport run gets its last 2 epochs later
    with redis.Redis.from_url(url) as r:
        for job, recs in zip(ids, runs, strict=True):
            emit(url, job, recs)
            summary = summarize(epoch_rows(recs), TARGET, sum(1 for x in recs if x["kind"] == "teleport"))
            r.hset(keys.job(job), "summary", json.dumps(summary))
    tab = tab_factory(api_only.url)
    page = tab.page
    tab.sign_in(api_only.stack.admin_token)

    # [1] epochs trained by default: x is epoch + 1, the teleport run's teleports at 0 and 3 epochs trained
    tab.goto(f"#/compare?ids={','.join(ids)}")
    got = wait_for_data(page, expected(runs, "epoch", "test_loss"))
    assert got["x"] == "epochs trained" and got["marks"] == teleport_marks(runs[0], "epoch")
    row = page.locator(f"#compare-body tr[data-job='{ids[0]}'] td.to-target")
    hit = next(r for r in epoch_rows(runs[0]) if r["train_loss"] < TARGET)
    assert row.inner_text() == f"< {TARGET}: {hit['epoch'] + 1} epochs · {hit['seconds']:.3g} s"

    # [2] switched to wall-clock seconds: x is each epoch's cumulative seconds, teleports where the epoch before ended
    page.select_option("#x-axis", "seconds")
    got = wait_for_data(page, expected(runs, "seconds", "test_loss"))
    assert got["x"] == "wall-clock seconds" and got["marks"] == teleport_marks(runs[0], "seconds") != [0.0, 3.0]
    assert page.evaluate("location.hash").endswith("&x=seconds")
    tab.shot("compare-seconds")

    # [3] the choice survives the page's refresh (two more epochs arrive) and a change of metric
    emit(url, ids[0], [r for r in full[0] if r["epoch"] >= 6])
    runs[0] = full[0]
    wait_for_data(page, expected(runs, "seconds", "test_loss"))
    page.select_option("#metric", "train_loss")
    got = wait_for_data(page, expected(runs, "seconds", "train_loss"))
    assert page.input_value("#x-axis") == "seconds" and got["x"] == "wall-clock seconds"

    # [4] and a reload: the address carries it
    page.reload()
    got = wait_for_data(page, expected(runs, "seconds", "test_loss"))
    assert page.input_value("#x-axis") == "seconds" and got["marks"] == teleport_marks(runs[0], "seconds")
    page.select_option("#x-axis", "epoch")
    wait_for_data(page, expected(runs, "epoch", "test_loss"))
    assert "x=" not in page.evaluate("location.hash")
    assert not tab.errors, tab.errors

    # [5] the API's figure takes the same choice; another axis is a 422 that names it
    with api_only.client() as c:
        png = c.get(f"/v1/experiments/{ids[0]}/plot.png", params={"compare": ids[1], "x": "seconds"})
        assert png.status_code == 200 and png.content[:4] == b"\x89PNG"
        bad = c.get(f"/v1/experiments/{ids[0]}/plot.png", params={"x": "steps"})
        assert bad.status_code == 422 and [e["field"] for e in bad.json()["errors"]] == ["x"], bad.text


def test_the_job_page_and_a_sweeps_trials_show_seconds_beside_epochs_to_target(api_only: Api,
                                                                                tab_factory: Any) -> None:
    recs = events(1.0, 0.9, {0: 1.3}, range(5))
    summary = summarize(epoch_rows(recs), TARGET, 1)
    hit = next(r for r in epoch_rows(recs) if r["train_loss"] < TARGET)
    want = f"< {TARGET}: {hit['epoch'] + 1} epochs · {hit['seconds']:.3g} s"
    with api_only.client() as c:
        job = c.post("/v1/experiments", json={"spec": tiny(), "name": "to-target"}).json()["id"]
        sweep = c.post("/v1/sweeps", json={"base": tiny(), "name": "to-target-sweep", "num_samples": 2,
                                           "search_space": {"optimizer.lr": {"loguniform": [1e-3, 1e-1]}}}).json()["id"]
    missed = summarize(epoch_rows(recs), 0.01, 1)
    with redis.Redis.from_url(api_only.stack.redis_url or "") as r:  # what the driver writes when a run ends
        r.hset(keys.job(job), "summary", json.dumps(summary))
        for trial, s in (("t0", summary), ("t1", missed)):
            r.hset(keys.trials(sweep), trial, json.dumps({"trial": trial, "config": {"optimizer.lr": 0.01},
                                                          "state": "running", "epochs": 5, "summary": s}))
    tab = tab_factory(api_only.url)
    page = tab.page
    tab.sign_in(api_only.stack.admin_token)
    tab.goto(f"#/job/{job}")
    page.wait_for_function(f"() => document.querySelector('#job-summary').innerText.includes({json.dumps(want)})")
    tab.goto(f"#/sweep/{sweep}")
    page.wait_for_function("() => document.querySelectorAll('#trials-body td.to-target').length === 2")
    cells = page.locator("#trials-body td.to-target")
    assert [cells.nth(i).inner_text() for i in range(2)] == [want, "< 0.01: not reached"]
    tab.shot("sweep-to-target", "#trials-body")
    assert not tab.errors, tab.errors
