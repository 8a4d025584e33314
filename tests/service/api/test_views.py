"""What the read routes answer, without HTTP: the cluster view's freshness, metrics as CSV, the log text."""

from __future__ import annotations

import csv
import io
import json
import time

from api_schemas import keys
from api_schemas.jobs import NodeView
from service.api.views import empty_cluster, log_text, metrics_csv, read_cluster_view
from service.core.store import Store


def publish(store: Store, at: float) -> None:
    view = empty_cluster().model_copy(update={"nodes": [NodeView(id="n1", alive=True, cpus_total=2, cpus_free=1,
                                                                   gpus_total=0, gpus_free=0)],
                                              "scheduler_alive": True})
    store.r.set(keys.cluster(), json.dumps({"view": view.model_dump(), "at": at}))


def test_cluster_view_is_alive_only_while_the_scheduler_publishes(redis_server: str) -> None:
    store = Store.from_url(redis_server)
    assert read_cluster_view(store, tick_s=1.0) == (None, 0.0)  # no scheduler has ever reported
    publish(store, time.time() - 3)
    view, age = read_cluster_view(store, tick_s=1.0)
    assert view is not None and view.scheduler_alive and view.nodes[0].id == "n1" and age >= 3
    publish(store, time.time() - 30)  # older than max(10 s, 5 ticks)
    view, _ = read_cluster_view(store, tick_s=1.0)
    assert view is not None and not view.scheduler_alive
    view, _ = read_cluster_view(store, tick_s=10.0)  # a slow scheduler is given 5 of its ticks
    assert view is not None and view.scheduler_alive


def test_metrics_csv_has_a_column_for_every_key_any_row_has() -> None:
    rows = [{"kind": "epoch", "epoch": 1, "train_loss": 0.5},
            {"kind": "epoch", "epoch": 2, "train_loss": 0.4, "test_loss": 0.45}]
    table = list(csv.reader(io.StringIO(metrics_csv(rows))))
    assert table == [["epoch", "train_loss", "test_loss"], ["1", "0.5", ""], ["2", "0.4", "0.45"]]
    assert metrics_csv([]).strip() == ""


def test_log_text_puts_the_driver_log_before_the_jobs_own_log_and_status_events() -> None:
    recs = [{"kind": "status", "state": "running"}, {"kind": "epoch", "epoch": 1}, {"kind": "log", "line": "hi"}]
    lines = log_text("driver line 1\ndriver line 2\n", recs).splitlines()
    assert lines[:2] == ["driver line 1", "driver line 2"]
    assert [json.loads(x)["kind"] for x in lines[2:]] == ["status", "log"]  # epochs are metrics, not logs
    assert log_text(None, []) == "\n"
