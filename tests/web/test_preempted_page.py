"""The job page says how often and by which job a job was preempted (headless chromium on the real API; the
job is moved on the real Redis as the scheduler moves a victim: no Ray needed)."""

from __future__ import annotations

from typing import Any

from api_schemas import keys
from api_schemas.jobs import JobState
from service.core.store import Store
from service.scheduler import preempt as preempting
from tests.service.conftest import Api, tiny


def test_the_job_page_says_who_preempted_it(api_only: Api, tab_factory: Any) -> None:
    with api_only.client() as c:
        job = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
    store = Store.from_url(api_only.stack.redis_url or "")
    assert store.transition(job, JobState.STARTING, expect=[JobState.QUEUED], attempts="1")
    assert store.transition(job, JobState.RUNNING, started_at="1.0")
    store.r.hset(keys.job(job), mapping={preempting.PREEMPTED_BY: "urgent-job", preempting.PREEMPTED_PRIORITY: "5"})
    assert preempting.requeue(store, store.raw(job), now=store.r.time()[0])
    tab = tab_factory(api_only.url)
    tab.goto()
    tab.sign_in(api_only.stack.admin_token)
    tab.goto(f"#/job/{job}")
    tab.page.wait_for_selector("#job-facts dt:text('preempted')")
    facts = tab.page.inner_text("#job-facts")
    assert "1 time(s); last: preempted by urgent-job (priority 5) at " in facts, facts
    assert not tab.errors, tab.errors
