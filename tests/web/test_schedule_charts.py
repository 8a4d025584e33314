"""A job trained with a learning-rate schedule and gradient clipping shows both on its page: a learning-rate chart
and a gradient-norm chart with the share of steps clipped (headless chromium on the real API; the run's records are
a real in-process run's, written to Redis by the sink a job's driver uses: no Ray needed)."""

from __future__ import annotations

from typing import Any

import pytest

from api_schemas import build_spec
from tests.service.conftest import Api, tiny
from workers.job.redis_sink import RedisSink
from workers.train.context import RunContext
from workers.train.loop import train
from workers.train.sinks import MemorySink, TeeSink

SCHEDULED = tiny(optimizer={"name": "sgd", "lr": 0.1, "schedule": "cosine", "lr_warmup_steps": 3},
                 training={"epochs": 3, "grad_clip_norm": 0.5}, teleport={"enabled": False})


def test_the_job_page_charts_the_learning_rate_and_the_clipped_gradient_norm(api_only: Api, tab_factory: Any) -> None:
    with api_only.client() as c:
        job = c.post("/v1/experiments", json={"spec": SCHEDULED}).json()["id"]
    kept, sink = MemorySink(), RedisSink(api_only.stack.redis_url or "", job)
    try:
        train(build_spec(SCHEDULED), RunContext(sink=TeeSink(kept, sink)))
    finally:
        sink.close()
    epochs = [r for r in kept.records if r["kind"] == "epoch"]
    tab = tab_factory(api_only.url)
    tab.goto()
    tab.sign_in(api_only.stack.admin_token)
    tab.goto(f"#/job/{job}")
    page = tab.page
    page.wait_for_function("() => window.tlab.charts.lr && window.tlab.charts.lr.data[0].length === 3")
    assert page.evaluate("window.tlab.charts.lr.data[1]") == pytest.approx([r["lr"] for r in epochs])
    assert epochs[0]["lr"] > epochs[-1]["lr"]  # the cosine decays
    page.wait_for_function("() => window.tlab.charts.grad && window.tlab.charts.grad.data[0].length === 3")
    assert page.evaluate("window.tlab.charts.grad.data[1]") == pytest.approx([r["grad_norm"] for r in epochs])
    clipped = round(100 * epochs[-1]["clipped"])
    assert page.inner_text("#clipped") == f"(epoch 2: {clipped} % of steps clipped)"
    tab.shot("job-schedule", "#lr-wrap")
    tab.shot("job-grad", "#grad-wrap")
    assert not tab.errors, tab.errors


def test_a_constant_rate_without_clipping_shows_neither_chart(api_only: Api, tab_factory: Any) -> None:
    plain = tiny(training={"epochs": 2}, teleport={"enabled": False})
    with api_only.client() as c:
        job = c.post("/v1/experiments", json={"spec": plain}).json()["id"]
    sink = RedisSink(api_only.stack.redis_url or "", job)
    try:
        train(build_spec(plain), RunContext(sink=sink))
    finally:
        sink.close()
    tab = tab_factory(api_only.url)
    tab.goto()
    tab.sign_in(api_only.stack.admin_token)
    tab.goto(f"#/job/{job}")
    tab.page.wait_for_function("() => window.tlab.charts.loss && window.tlab.charts.loss.data[0].length === 2")
    assert tab.page.evaluate("[!!window.tlab.charts.lr, !!window.tlab.charts.grad]") == [False, False]
    assert tab.page.is_hidden("#lr-wrap") and tab.page.is_hidden("#grad-wrap")
    assert not tab.errors, tab.errors
