"""The job page's teleport table in a real chromium: one row per teleport epoch, expandable to its batches.

The teleport events are written by the workers' own Redis sink into a queued job's stream (what rank 0 does
while a job runs), so the page gets them over the real SSE route without starting Ray.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from typing import Any

import redis

from api_schemas import keys
from tests.service.conftest import Api, tiny
from workers.job.redis_sink import RedisSink

BATCHES = {0: 4, 2: 3, 5: 5}  # teleport epoch -> batches (even and odd counts: both kinds of median)
LONG_REASON = ("waits: needs 2 × (1 CPU) but node n1 has 0.5 CPUs free and node n2 is held by job "
               "j-0123456789 until its time limit; fair share puts bob's 3 queued jobs first (decayed usage 41 h)")


def teleport_event(epoch: int, batch: int) -> dict[str, Any]:
    """One teleport batch's record, as workers/train/loop.py emits it (values differ per batch and epoch)."""
    before = 1.0 + 0.5 * batch + epoch
    return {"kind": "teleport", "epoch": epoch, "batch": batch, "method": "nullspace",
            "loss_before": 2.0 + 0.1 * batch, "loss_after": (2.0 + 0.1 * batch) * (1 + 1e-4 * (batch - 1)),
            "grad_norm_sq_before": before, "grad_norm_sq_after": before * (1.5 + 0.75 * ((batch * 7) % 5)),
            "steps": 2 + batch % 3, "backoffs": batch % 2,
            "stop_reason": ["cap", "steps", "cap", "loss_tol"][batch % 4],
            "seconds": 0.25, "untouched": [],
            "layers": [{"name": "fc1", "kind": "linear", "input_dim": 65, "rank": 60 + batch, "free": 5 - batch % 5,
                        "captured_variance": 1.0},
                       {"name": "fc2", "kind": "linear", "input_dim": 33, "rank": 33, "free": 0,
                        "captured_variance": 1.0}],
            "heldout_loss_before": 2.5 + 0.01 * batch, "heldout_loss_after": 2.5 + 0.01 * batch + 0.002}


def expected(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the epoch row must say, computed here from the same events."""
    ratios = [t["grad_norm_sq_after"] / t["grad_norm_sq_before"] for t in events]
    drifts = [(t["loss_after"] - t["loss_before"]) / abs(t["loss_before"]) for t in events]
    first, last = events[0], events[-1]
    return {"batches": len(events), "steps": sum(t["steps"] for t in events),
            "ratio": (min(ratios), statistics.median(ratios), max(ratios)),
            "drift": (min(drifts), statistics.median(drifts), max(drifts)),
            "heldout": (last["heldout_loss_after"] - first["heldout_loss_before"]) / first["heldout_loss_before"],
            "stops": ", ".join(f"{k} ×{n}" for k, n in Counter(t["stop_reason"] for t in events).most_common()),
            "fc1_free": min(layer["free"] for t in events for layer in t["layers"] if layer["name"] == "fc1")}


SPREADS = """(epoch) => [...document.querySelectorAll(`tbody[data-epoch="${epoch}"] tr.epoch-row td.spread`)]
  .map((td) => [td.dataset.min, td.dataset.median, td.dataset.max].map(Number))"""
CLIPPED = """(sel) => { const el = document.querySelector(sel);
  return el ? [el.title, el.scrollWidth > el.clientWidth] : null; }"""


def test_teleports_are_grouped_by_epoch_and_expand_to_their_batches(api_only: Api, tab_factory: Any) -> None:
    with api_only.client() as c:
        job = c.post("/v1/experiments", json={"spec": tiny(), "name": "grouped"}).json()["id"]
    url = api_only.stack.redis_url or ""
    events = {e: [teleport_event(e, b) for b in range(n)] for e, n in BATCHES.items()}
    sink = RedisSink(url, job)
    for e in BATCHES:  # batches out of order within an epoch: the table sorts them
        for t in sorted(events[e], key=lambda t: -t["batch"]):
            sink.emit(t)
    sink.close()

    tab = tab_factory(api_only.url)
    page = tab.page
    tab.sign_in(api_only.stack.admin_token)
    tab.goto(f"#/job/{job}")
    rows = page.locator("#tele-table tr.epoch-row")
    page.wait_for_function(f"() => document.querySelectorAll('#tele-table tr.epoch-row').length === {len(BATCHES)}")
    assert page.locator("#tele-table tr.batch-row:visible").count() == 0  # all folded
    assert [int(rows.nth(i).get_attribute("data-epoch") or -1) for i in range(rows.count())] == sorted(BATCHES)[::-1]
    assert page.inner_text("#tele-method") == "nullspace"
    assert page.inner_text("#tele-count") == f"{sum(BATCHES.values())} teleport batches in {len(BATCHES)} epochs"

    for epoch, evs in events.items():  # [1] every epoch row's figures match the events
        want = expected(evs)
        row = page.locator(f"#tele-table tr.epoch-row[data-epoch='{epoch}']")
        (ratio, drift) = page.evaluate(SPREADS, epoch)
        assert ratio == [float(x) for x in want["ratio"]] and drift == [float(x) for x in want["drift"]], epoch
        assert float(row.locator("td.heldout").get_attribute("data-value") or "nan") == want["heldout"]
        assert int(row.locator("td.n-batches").inner_text()) == want["batches"]
        cells = row.inner_text()
        assert want["stops"] in cells and f"fc1 {want['fc1_free']}/65" in cells and "fc2 0/33" in cells, cells
        assert cells.split("\t")[2].startswith(str(want["steps"])), cells

    # [2] a click on epoch 2's row shows its 3 batches in order, with their own figures; another click folds them
    row = page.locator("#tele-table tr.epoch-row[data-epoch='2']")
    row.click()
    batches = page.locator("#tele-table tr.batch-row[data-epoch='2']:visible")
    assert batches.count() == BATCHES[2]
    assert page.locator("#tele-table tr.batch-row:visible").count() == BATCHES[2]  # only that epoch's
    assert row.locator("button.expand").get_attribute("aria-expanded") == "true"
    for b, t in enumerate(events[2]):
        text = batches.nth(b).inner_text()
        ratio = t["grad_norm_sq_after"] / t["grad_norm_sq_before"]
        assert f"batch {b}" in text and f"×{ratio:.6g}" in text and t["stop_reason"] in text and "/65" in text, text
    tab.shot("job-teleports-grouped")

    # [3] the expansion survives a redraw (a late event for another epoch) and folds again on a click
    sink = RedisSink(url, job)
    sink.emit(teleport_event(7, 0))
    sink.close()
    page.wait_for_function(f"() => document.querySelectorAll('#tele-table tr.epoch-row').length === {len(BATCHES) + 1}")
    assert page.locator("#tele-table tr.batch-row:visible").count() == BATCHES[2]
    assert page.locator("#tele-table tr.epoch-row").first.get_attribute("data-epoch") == "7"
    page.locator("#tele-table tr.epoch-row[data-epoch='2']").click()
    assert page.locator("#tele-table tr.batch-row:visible").count() == 0
    tab.shot("job-page-teleports", "#tele-wrap")

    # [4] what the run says to a person (a budget cut, a setting that leaves teleport idle) is in the events log
    said = [{"kind": "budget", "epoch": 8, "message": "teleport at epoch 8 shortened to 2 batches: budget 10 %"},
            {"kind": "hint", "epoch": 9, "reason": "cap",
             "message": "teleport at epoch 9: every batch's ‖∇L‖² (702 to 731) was already at or over teleport.cap "
                        "(5): no step; raise teleport.cap above 731 to let teleport move"}]
    sink = RedisSink(url, job)
    for record in said:
        sink.emit(record)
    sink.close()
    for record in said:
        line = f"[{record['kind']}] {record['message']}"
        page.wait_for_function(f"() => document.querySelector('#events-log').innerText.includes({json.dumps(line)})")
    assert not tab.errors, tab.errors


def test_a_long_reason_is_cut_in_the_tables_with_the_whole_text_in_its_tooltip(api_only: Api, tab_factory: Any) -> None:
    with api_only.client() as c:
        job = c.post("/v1/experiments", json={"spec": tiny(resources={"memory_gb": 2}), "name": "waits-long"}
                     ).json()["id"]
    with redis.Redis.from_url(api_only.stack.redis_url or "") as r:  # what the scheduler publishes
        r.hset(keys.queue_view(), job, json.dumps({"position": 1, "reason": LONG_REASON}))
    tab = tab_factory(api_only.url)
    page = tab.page
    tab.sign_in(api_only.stack.admin_token)
    for sel in (f"#jobs-body tr[data-job='{job}'] td.reason .clip", "#queue-body td.reason .clip"):
        page.wait_for_function(f"() => ({CLIPPED})({json.dumps(sel)})?.[0] === {json.dumps(LONG_REASON)}")
        title, cut = page.evaluate(CLIPPED, sel)
        assert title == LONG_REASON and cut, (sel, title, cut)  # one line with an ellipsis, the whole in the title
    tab.shot("jobs-long-reason")
    tab.goto(f"#/job/{job}")  # the job's own page says it in full
    page.wait_for_function(f"() => document.querySelector('#job-facts').innerText.includes({json.dumps(LONG_REASON)})")
    assert "1 × (1 CPU, 2 GiB)" in page.inner_text("#job-facts")  # what it needs: its memory too
    assert not tab.errors, tab.errors
