"""The web dashboard in a real headless chromium, on the real API (and, for the live test, real Ray).

The live test signs in, submits a job from the page, watches the loss chart's data grow as SSE events
arrive, checks the line's pixels in screenshots of the chart's canvas, and cancels the job from the page.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from PIL import Image

from service.stack.embedded import Stack
from tests.service.conftest import Api, tiny, wait_ray_idle

TRAIN_RGB = (0x1F, 0x77, 0xB4)  # charts.js TRAIN (blue)
TEST_RGB = (0xFF, 0x7F, 0x0E)  # charts.js TEST (orange)
CHART_POINTS = "() => window.tlab.charts.loss ? window.tlab.charts.loss.data[0].length : -1"


def chart_canvas(tab: Any, name: str) -> tuple[int, Path]:
    """The chart's point count and its canvas's own pixels, read in one step of the page's JS (a screenshot of
    the canvas's box is of the page there, and another part of the page moving into it mid-shot counted as
    line pixels once)."""
    import base64

    points, url = tab.page.evaluate(f"() => {{ const u = window.tlab.charts.{name}; "
                                    "return [u.data[0].length, u.ctx.canvas.toDataURL('image/png')]; }")
    path = tab.shots / f"{name}-canvas-{points}.png"
    path.write_bytes(base64.b64decode(url.split(",", 1)[1]))
    return points, path


def colour_pixels(png: Path, rgb: tuple[int, int, int], tol: int = 30) -> tuple[int, int]:
    """How many pixels of the image are within ``tol`` of ``rgb`` per channel, and their horizontal span."""
    with Image.open(png) as im:
        a = np.asarray(im.convert("RGB")).astype(int)  # (H, W, 3)
    mask = (np.abs(a - np.array(rgb)) <= tol).all(axis=-1)  # (H, W)
    cols = np.flatnonzero(mask.any(axis=0))
    return int(mask.sum()), int(cols[-1] - cols[0]) if cols.size else 0


def kinds(sse_text: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in sse_text.splitlines() if line.startswith("event: ")]


def test_page_and_vendored_files_are_served_and_sse_takes_a_token_query(api_only: Api) -> None:
    admin = api_only.stack.admin_token
    bob = api_only.add_user("bob")
    with httpx.Client(base_url=api_only.url, timeout=30) as anon:
        page = anon.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'src="static/app.js"' in page.text and "static/vendor/uPlot.iife.min.js" in page.text
        views = [f"views/{v}.js" for v in ("signin", "jobs", "job", "teleports", "submit", "compare", "sweeps",
                                           "cluster", "artifacts")]
        scripts = ["app.js", "api.js", "charts.js", "dom.js", "page.js", *views]  # ES modules, no build step
        for path, ctype in [*((s, "javascript") for s in scripts), ("app.css", "text/css"),
                            ("vendor/uPlot.iife.min.js", "javascript"), ("vendor/uPlot.min.css", "text/css")]:
            r = anon.get(f"/static/{path}")
            assert r.status_code == 200 and ctype in r.headers["content-type"] and len(r.content) > 500, path
        assert "uPlot" in anon.get("/static/vendor/uPlot.iife.min.js").text
        assert anon.get("/static/nope.js").status_code == 404
        paths = anon.get("/openapi.json").json()["paths"]
        assert "/" not in paths and not any(p.startswith("/static") for p in paths)
        token_param = [p for p in paths["/v1/experiments/{job_id}/events"]["get"]["parameters"] if p["name"] == "token"]
        assert token_param and token_param[0]["in"] == "query"

    with api_only.client() as c:  # a cancelled job: its stream is complete, so a GET returns
        job = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
        assert c.post(f"/v1/experiments/{job}/cancel").status_code == 202
    events = f"/v1/experiments/{job}/events"
    with httpx.Client(base_url=api_only.url, timeout=30) as anon:
        r = anon.get(events, params={"token": admin})  # what a browser's EventSource does
        assert r.status_code == 200 and kinds(r.text) == ["status", "status", "end"]
        assert anon.get(events).status_code == 401
        wrong = anon.get(events, params={"token": "wrong"})
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
        assert anon.get(events, params={"token": bob}).status_code == 403  # bob's token, admin's job
        # the Authorization header stays primary: it wins over ?token= either way
        as_header = {"Authorization": f"Bearer {admin}"}
        assert anon.get(events, params={"token": "wrong"}, headers=as_header).status_code == 200
        assert anon.get(events, params={"token": admin}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        # the sweep stream takes it too (this id is an experiment: 404, past the auth check)
        assert anon.get(f"/v1/sweeps/{job}/events", params={"token": admin}).status_code == 404
        assert anon.get(f"/v1/sweeps/{job}/events", params={"token": "wrong"}).status_code == 401
        # only the streams: elsewhere a token in the URL is no credential
        assert anon.get(f"/v1/experiments/{job}", params={"token": admin}).status_code == 401


def test_sign_in_tables_errors_and_cancel_without_ray(api_only: Api, tab_factory: Any) -> None:
    """On the API alone (jobs stay queued): sign in, live tables, a field-path error, cancel, sign out."""
    tab = tab_factory(api_only.url)
    page = tab.page
    tab.goto()
    page.wait_for_function("() => location.hash === '#/signin'")
    page.fill("#token", "not-a-token")
    page.click("#signin-form button[type=submit]")
    page.wait_for_selector("#error:not([hidden])")
    assert "401" in page.inner_text("#error") and page.evaluate("localStorage.getItem('tlab.token')") is None
    tab.sign_in(api_only.stack.admin_token)
    assert page.inner_text("#who").startswith("admin (admin) · ") and " GB stored" in page.inner_text("#who")

    with api_only.client() as c:  # submitted elsewhere while the page is open: the tables pick it up
        job = c.post("/v1/experiments", json={"spec": tiny(), "name": "from-rest"}).json()["id"]
    row = page.locator(f"#jobs-body tr[data-job='{job}']")
    row.wait_for()
    assert "queued" in row.inner_text() and "from-rest" in row.inner_text()
    page.wait_for_function("() => document.querySelector('#queue-body').innerText.includes('from-rest')")
    tab.shot("jobs-queued")

    # an invalid spec from the submit form: the API's one line, field path first
    page.click("#nav a[data-route=submit]")
    page.select_option("#preset", "digits/teleport")
    assert json.loads(page.input_value("#spec"))["dataset"]["name"] == "digits"
    page.fill("#overrides", "training.epochs=0")
    page.click("#submit")
    page.wait_for_selector("#error:not([hidden])")
    error = page.inner_text("#error")
    assert error.startswith("422: ") and "spec.training.epochs" in error and "\n" not in error, error
    tab.shot("submit-error")
    page.fill("#spec", "{not json")
    page.click("#dry-run")
    page.wait_for_function("() => document.querySelector('#error').innerText.startsWith('spec: not valid JSON')")

    # an epoch of a 2-rank GPU job, as its rank 0 writes it: the page shows each rank's GPU memory
    from workers.job.redis_sink import RedisSink

    sink = RedisSink(api_only.stack.redis_url or "", job)
    sink.emit({"kind": "epoch", "epoch": 0, "train_loss": 1.0, "test_loss": 1.0, "gpu_memory_mb": 640.0,
               "gpu_memory_mb_ranks": [640.0, 598.5]})
    sink.close()
    # and its summary's device line (``workers.train.gpu_share.device_report``): the peak host memory beside the GPU's
    from workers.job.record import write_summary

    with redis.Redis.from_url(api_only.stack.redis_url or "") as r:
        write_summary(r, job, json.dumps({"device": "cuda:0", "cuda_visible_devices": "1",
                                          "host_memory_peak_mb": 412.5, "gpu_memory_peak_mb": 812.0}))
    # cancel the queued job from its page: two clicks, then REST agrees
    tab.goto(f"#/job/{job}")
    page.wait_for_selector("#cancel:not([hidden])")
    assert "why pending" in page.inner_text("#job-facts")
    assert "rank 0 640 · rank 1 598.5 MiB at most so far" in page.inner_text("#job-facts")
    assert ('cuda:0 · CUDA_VISIBLE_DEVICES="1" · peak host memory 412.5 MiB · peak GPU memory 812 MiB'
            in page.inner_text("#job-facts")), page.inner_text("#job-facts")
    page.click("#cancel")
    assert page.inner_text("#cancel") == "Click again to cancel"
    page.click("#cancel")
    page.wait_for_selector("#job-state .state-cancelled")
    with api_only.client() as c:
        assert c.get(f"/v1/experiments/{job}").json()["state"] == "cancelled"
    # ended: its delete button (two clicks too) removes it with its files, and the page goes back to the list
    page.wait_for_selector("#delete:not([hidden])")
    page.click("#delete")
    assert page.inner_text("#delete") == "Click again: delete it and its files"
    page.click("#delete")
    page.wait_for_function("() => location.hash === '#/jobs'")
    with api_only.client() as c:
        assert c.get(f"/v1/experiments/{job}").status_code == 404

    # a sweep's page: queued, with why, and cancellable
    with api_only.client() as c:
        sweep = c.post("/v1/sweeps", json={"base": tiny(), "name": "lr-sweep", "num_samples": 2,
                                           "search_space": {"teleport.lr": {"loguniform": [0.01, 1]}}}).json()["id"]
    page.click("#nav a[data-route=sweeps]")
    page.click(f"#sweeps-body a[href='#/sweep/{sweep}']")
    page.wait_for_selector("#sweep-state .state-queued")
    assert "queued" in page.inner_text("#sweep-best") and "no trial has reported" in page.inner_text("#trials-body")
    tab.shot("sweep-queued")
    page.click("#cancel")
    page.click("#cancel")
    page.wait_for_selector("#sweep-state .state-cancelled")

    page.click("#nav a[data-route=cluster]")
    page.wait_for_selector("#cluster-summary .state-failed")  # no scheduler in this fixture: said so
    # what a scheduler publishes when other Ray work holds CPUs on a shared cluster: the page says so
    from api_schemas import keys
    from api_schemas.jobs import ClusterView, NodeShare, NodeView

    # each running job's share of the node, and the GPU memory its ranks there reported with its last epoch
    # and the host memory Ray reserves for it (resources.memory_gb); a node whose memory is not known says so
    shares = [NodeShare(job="gang-of-halves", workers=2, cpus=2, gpus=1.0, gpu_memory_mb=812.5, memory_gb=6)]
    view = ClusterView(nodes=[NodeView(id="n1", alive=True, cpus_total=4, cpus_free=1, gpus_total=2, gpus_free=1,
                                       gpu_type="H100", jobs=shares, memory_gb_total=64, memory_gb_free=58),
                              NodeView(id="n2", alive=True, cpus_total=4, cpus_free=4, gpus_total=0, gpus_free=0)],
                       cpus_total=4, cpus_free=1, gpus_total=1, gpus_free=1, running_jobs=[], scheduler_alive=True,
                       cpus_outside=3, memory_gb_total=64, memory_gb_free=58, memory_gb_outside=2)
    with redis.Redis.from_url(api_only.stack.redis_url or "") as r:
        r.set(keys.cluster(), json.dumps({"view": view.model_dump(), "at": time.time()}))
    page.wait_for_selector("#cluster-summary #outside", timeout=15_000)
    assert "Ray holds 3 CPUs, 0 GPUs, 2.0 GiB beyond Teleport Lab's jobs" in page.inner_text("#outside")
    node = page.inner_text("#nodes-body")
    assert "H100" in node and "gang-of-halves" in node and "1 GPU" in node and "812.5 MiB" in node, node
    assert "58.0 / 64.0" in node and "6 GiB" in node and "not known" in node, node
    assert "memory 58.0 GiB free of 64.0" in page.inner_text("#cluster-summary")
    assert "alive" in page.inner_text("#cluster-summary")
    # a node with a long name and many shares still fits the 1280-px window (the tab's viewport): no sideways scroll
    crowded = NodeView(id="f" * 56, hostname="gpunode" + "0123456789" * 5, address="10.20.30.40",
                       alive=True, cpus_total=64, cpus_free=8, gpus_total=8, gpus_free=0, gpu_type="H100",
                       memory_gb_total=512, memory_gb_free=100, jobs=[NodeShare(
                           job=f"1a24b0b9203-cc05{i:02d}", workers=1, cpus=7, gpus=1.0, gpu_memory_mb=40960.5,
                           memory_gb=50) for i in range(8)])
    view = view.model_copy(update={"nodes": [*view.nodes, crowded]})
    with redis.Redis.from_url(api_only.stack.redis_url or "") as r:
        r.set(keys.cluster(), json.dumps({"view": view.model_dump(), "at": time.time()}))
    page.wait_for_function("() => document.querySelectorAll('#nodes-body tr').length === 3", timeout=15_000)
    wide = page.evaluate("() => [document.documentElement.scrollWidth, document.querySelector('table.cluster')"
                         ".closest('.card').scrollWidth, document.querySelector('table.cluster').closest('.card')"
                         ".clientWidth]")
    assert wide[0] <= 1280 and wide[1] <= wide[2], wide
    page.click("#signout")
    page.wait_for_function("() => location.hash === '#/signin'")
    assert page.evaluate("localStorage.getItem('tlab.token')") is None
    assert not tab.errors, tab.errors


@pytest.mark.slow
def test_submit_watch_the_curve_grow_and_cancel_in_the_browser(stack: Stack, tab_factory: Any) -> None:
    tab = tab_factory(stack.url)
    page = tab.page
    tab.sign_in(stack.admin_token)

    # [1] submit from the page: a job long enough to be cancelled, teleporting at epochs 1 and 2
    page.click("#nav a[data-route=submit]")
    spec = tiny(training={"epochs": 100_000}, teleport={"enabled": True, "epochs": [1, 2], "batches": 2, "steps": 2})
    page.fill("#spec", json.dumps(spec))
    page.fill("#name", "from-the-browser")
    page.click("#submit")
    page.wait_for_function("() => location.hash.startsWith('#/job/')")
    job = page.evaluate("location.hash").removeprefix("#/job/")
    page.wait_for_function(f"() => ({CHART_POINTS})() >= 0")  # the chart exists
    before, empty = chart_canvas(tab, "loss")
    if before == 0:  # nothing drawn yet: no line colours (a control)
        assert colour_pixels(empty, TRAIN_RGB)[0] == 0

    # [2] the curve grows as metric events arrive over SSE
    page.wait_for_function(f"() => ({CHART_POINTS})() >= 5", timeout=180_000)
    n1 = page.evaluate(CHART_POINTS)
    first = tab.shot("loss-early", "#loss-chart canvas")
    page.wait_for_function(f"() => ({CHART_POINTS})() >= {n1 + 20}", timeout=60_000)
    n2 = page.evaluate(CHART_POINTS)
    later = tab.shot("loss-later", "#loss-chart canvas")
    assert n2 > n1 >= 5
    with Image.open(later) as im:
        width = im.width
    for png in (first, later):
        for rgb in (TRAIN_RGB, TEST_RGB):
            count, span = colour_pixels(png, rgb)
            assert count > 50 and span > width // 2, (png.name, rgb, count, span, width)  # a line across the plot
    xs = page.evaluate("window.tlab.charts.loss.data[0]")
    assert xs == list(range(len(xs)))  # epochs 0, 1, 2, ... each once

    # [3] teleport diagnostics, one row per teleport epoch (1 and 2); a click shows that epoch's 2 batches with
    # ‖∇L‖² before/after, drift and free directions per layer
    page.wait_for_function("() => document.querySelectorAll('#tele-table tr.epoch-row').length === 2")
    page.locator("#tele-table tr.epoch-row[data-epoch='1']").click()
    batches = page.locator("#tele-table tr.batch-row[data-epoch='1']:visible")
    assert batches.count() == 2
    tele = batches.nth(0).inner_text() + batches.nth(1).inner_text()
    # free / input dim of the two Linear layers (digits: 64 features, 32 hidden; +1 for the bias column)
    assert "/65" in tele and "/33" in tele and page.inner_text("#tele-method") == "nullspace", tele
    page.wait_for_function("() => window.tlab.charts.teleport.data[0].length === 4")  # 2 epochs x 2 batches
    tab.shot("job-page")

    # [4] the jobs table shows it running, with progress; back on its page the history replays
    page.click("#nav a[data-route=jobs]")
    row = page.locator(f"#jobs-body tr[data-job='{job}']")
    row.wait_for()
    page.wait_for_function(f"() => document.querySelector(\"#jobs-body tr[data-job='{job}'] .bar\") !== null")
    assert "running" in row.inner_text()
    tab.shot("jobs-running")
    page.click(f"#jobs-body tr[data-job='{job}'] a")
    page.wait_for_function(f"() => ({CHART_POINTS})() >= {n2}", timeout=60_000)

    # [5] cancel from the page; the stream ends and REST agrees
    page.click("#cancel")
    page.click("#cancel")
    page.wait_for_selector("#job-state .state-cancelled", timeout=60_000)
    page.wait_for_function("() => document.querySelector('#live').innerText === 'ended: cancelled'", timeout=60_000)
    tab.shot("job-cancelled")
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.admin_token}"}) as c:
        view = c.get(f"/v1/experiments/{job}").json()
        assert view["state"] == "cancelled" and view["name"] == "from-the-browser"
        assert view["progress"]["epoch"] < 100_000
    frozen = page.evaluate(CHART_POINTS)
    time.sleep(1.0)
    assert page.evaluate(CHART_POINTS) == frozen  # the stream is closed: nothing more arrives

    # [6] the compare view overlays it (one series per picked job) from /metrics
    tab.goto(f"#/compare?ids={job}")
    page.wait_for_function("() => window.tlab.charts.compare && window.tlab.charts.compare.data.length === 2")
    assert page.evaluate("window.tlab.charts.compare.data[1].filter(v => v !== null).length") >= n2
    assert "from-the-browser" in page.inner_text("#compare-body")
    tab.shot("compare")

    # [7] the cluster page: the Ray head's node with its CPUs
    page.click("#nav a[data-route=cluster]")
    page.wait_for_selector("#nodes-body tr td.mono")
    assert "CPUs" in page.inner_text("#cluster-summary")
    tab.shot("cluster")
    assert not tab.errors, tab.errors


SWEEP_POINTS = """() => { const c = window.tlab.charts.sweep;
  return c ? c.data.slice(1).map((s) => s.filter((v) => v !== null).length) : []; }"""


@pytest.mark.slow
def test_a_running_sweeps_page_draws_every_trials_curve_and_marks_the_best(stack: Stack, tab_factory: Any) -> None:
    spec = tiny(training={"epochs": 200}, teleport={"enabled": True, "epochs": [0], "batches": 1, "steps": 2},
                resources={"cpus_per_worker": 0.9})  # two trials at once on the 2-CPU head
    wait_ray_idle(stack)
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.admin_token}"}) as c:
        r = c.post("/v1/sweeps", json={"base": spec, "name": "live-sweep", "max_concurrent_trials": 2,
                                        "search_space": {"optimizer.lr": {"grid": [0.01, 0.3]}}})  # apart
        assert r.status_code == 201, r.text
        sweep = r.json()["id"]
    tab = tab_factory(stack.url)
    page = tab.page
    tab.sign_in(stack.admin_token)
    tab.goto(f"#/sweep/{sweep}")

    # [1] while the trials run: one series per trial, each seen growing as its epochs arrive over SSE (the
    # trials need not overlap: 200 tiny epochs can end before the other trial's workers are up)
    seen: dict[int, list[int]] = {}
    deadline = time.monotonic() + 240
    while not (len(seen) == 2 and all(len({k for k in n if k > 0}) >= 2 for n in seen.values())):
        assert time.monotonic() < deadline, f"the trials' series did not grow: {seen}"
        for i, n in enumerate(page.evaluate(SWEEP_POINTS)):
            seen.setdefault(i, []).append(n)
        time.sleep(0.05)
    tab.shot("sweep-running", "#sweep-chart canvas")

    # [2] when the sweep ends: every epoch of both trials drawn, the table final and the best row marked
    page.wait_for_selector("#sweep-state .state-succeeded", timeout=300_000)
    page.wait_for_function("() => document.querySelector('#live').innerText === 'ended: succeeded'")
    page.wait_for_function(f"() => Math.min(...({SWEEP_POINTS})()) === 200", timeout=30_000)
    rows = page.locator("#trials-body tr")
    assert rows.count() == 2 and page.inner_text("#trials-body").count("succeeded") == 2
    assert page.locator("#trials-body tr.best").count() == 1
    assert page.inner_text("#sweep-best").startswith("best: "), page.inner_text("#sweep-best")  # not "so far"
    png = tab.shot("sweep-done-chart", "#sweep-chart canvas")
    with Image.open(png) as im:
        width = im.width
    for rgb in (TRAIN_RGB, TEST_RGB):  # PALETTE[0] and PALETTE[1]: the two trials' lines, across the plot
        count, span = colour_pixels(png, rgb)
        assert count > 50 and span > width // 2, (rgb, count, span, width)
    # [3] the best trial's artifacts, linked as on a job's page: the weights download with the token, byte for byte
    page.wait_for_selector("#artifacts a[data-name='model.safetensors']")
    assert "summary.json" in page.inner_text("#artifacts") and f"tlab pull {sweep}" in page.inner_text("body")
    with page.expect_download() as info:
        page.click("#artifacts a[data-name='model.safetensors']")
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.admin_token}"}) as c:
        weights = c.get(f"/v1/sweeps/{sweep}/artifacts/model.safetensors").content
    assert info.value.suggested_filename == "model.safetensors"
    assert Path(info.value.path()).read_bytes() == weights and weights
    tab.shot("sweep-done")
    assert not tab.errors, tab.errors
