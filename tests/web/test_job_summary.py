"""A job's summary on its page is a table with teleport's share of the run, and — when it was started beside a
baseline (`tlab demo` tags it `baseline:<id>`) — a verdict that puts seconds first; the jobs list shows an ended
job's last losses. Summaries are written to Redis as a job's driver writes them (no Ray)."""

from __future__ import annotations

import json
from typing import Any

import redis

from api_schemas import keys
from tests.service.conftest import Api, tiny

TELEPORT = {"epochs": 12, "final_train_loss": 0.0049, "final_test_loss": 0.1645, "final_test_acc": 0.9666,
            "best_test_acc": 0.97, "seconds": 1.4, "teleport_seconds": 0.83, "teleport_share": 0.59,
            "teleport_batches": 8, "teleport_budget": 0.1, "teleport_cuts": 2, "target_loss": 0.05,
            "epochs_to_target": 8, "seconds_to_target": 1.1}
BASELINE = {**TELEPORT, "final_train_loss": 0.0363, "final_test_loss": 0.1409, "seconds": 0.6, "teleport_seconds": 0.0,
            "teleport_share": 0.0, "teleport_batches": 0, "teleport_budget": None, "teleport_cuts": 0,
            "epochs_to_target": 16, "seconds_to_target": 0.5}


def test_the_summary_table_says_teleports_share_and_the_verdict_against_its_baseline(api_only: Api,
                                                                                      tab_factory: Any) -> None:
    with api_only.client() as c:
        base = c.post("/v1/experiments", json={"spec": tiny(), "name": "without teleport"}).json()["id"]
        tele = c.post("/v1/experiments", json={"spec": tiny(), "name": "with teleport",
                                               "tags": ["demo", f"baseline:{base}"]}).json()["id"]
    with redis.Redis.from_url(api_only.stack.redis_url or "") as r:  # what the drivers write when the runs end
        for job, summary in ((tele, TELEPORT), (base, BASELINE)):
            r.hset(keys.job(job), mapping={"summary": json.dumps(summary), "state": "succeeded"})
    tab = tab_factory(api_only.url)
    page = tab.page
    tab.sign_in(api_only.stack.admin_token)
    tab.goto(f"#/job/{tele}")
    want = "teleport lost on wall-clock: 2.2x more seconds to the target, though 2x fewer epochs " \
           "(teleport took 59 % of its run)"
    page.wait_for_function(f"() => document.querySelector('#job-summary').innerText.includes({json.dumps(want)})")
    table = {page.locator("#job-summary th").nth(i).inner_text(): page.locator("#job-summary td").nth(i).inner_text()
             for i in range(page.locator("#job-summary th").count())}
    assert table["teleport's share of it"] == "59 % (0.83 s, 8 batches)"
    assert table["teleport budget"] == "10 %; 2 teleport epochs cut short"
    assert table["to target loss"] == "< 0.05: 8 epochs · 1.1 s" and table["baseline"] == "without teleport"
    assert "summary" not in page.inner_text("#job-facts")  # no raw key=value dump any more
    tab.shot("job-summary", "#job-summary")
    tab.goto(f"#/job/{base}")  # the baseline itself has no baseline: no verdict
    page.wait_for_function("() => document.querySelector('#job-summary').innerText.includes('wall clock')")
    assert "verdict" not in page.inner_text("#job-summary")
    tab.goto("#/jobs")  # ended jobs show their last train / test loss
    page.wait_for_selector(f"tr[data-job='{tele}']")
    assert "0.0049 / 0.1645" in page.inner_text(f"tr[data-job='{tele}']")
    assert "0.0363 / 0.1409" in page.inner_text(f"tr[data-job='{base}']")
    assert not tab.errors, tab.errors
