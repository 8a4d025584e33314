"""Smoke runs of the service benchmark's cheap parts (real Redis and API processes, tiny sizes), checking the
result JSON's shape and counts — never the timings. The Ray part (submit to first epoch) is left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import run_all, service_bench
from benchmarks.service.common import Sizes, pct
from benchmarks.service.decisions import synthetic_load
from benchmarks.service.sse import _parse_sse
from benchmarks.service.startup import TIMELINE, timeline_segments


def _load(path: Path) -> dict:
    body = json.loads(path.read_text())
    assert body["benchmark"] == "service" and body["quick"] is True
    assert {"torch", "cpu_count", "platform", "date"} <= body["machine"].keys()
    return body


def test_registered_in_run_all() -> None:
    assert "service_bench" in run_all.ORDER and "service_bench" in run_all.discover()
    assert "service" not in run_all.discover()  # the parts package is run by service_bench, not on its own


def test_pure_helpers() -> None:
    assert pct([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert pct([3.0, 1.0, 2.0, 4.0], 0.99) == 4.0
    assert _parse_sse(b'id: 1-0\nevent: metric\ndata: {"epoch": 1}') == ("1-0", "metric", '{"epoch": 1}')
    queued, active = synthetic_load(Sizes(queued=30, users=3, active=5))
    assert len(queued) == 30 and len(active) == 5 and {q["owner"] for q in queued} <= {"user0", "user1", "user2"}


def test_startup_timeline_rows_tile_submit_to_first_checkpoint() -> None:
    """Each row runs from the latest earlier mark present, so the rows add up to submit -> first checkpoint
    whichever phases a path skips (a 1-worker driver: the gang's; a TorchTrainer: data and model too)."""
    one = {"submit_sent": 0.0, "starting": 0.5, "spawned": 1.0, "driver": 1.25, "torch": 2.0, "data": 2.5,
           "model": 2.75, "train_start": 3.0, "first_metric": 3.5, "checkpoint": 3.625}
    gang = {**one, "ranks": 1.5, "group": 2.25}
    trainer = {k: v for k, v in one.items() if k not in ("data", "model", "checkpoint")}
    for marks, skipped in ((one, 2), (gang, 0), (trainer, 5)):
        seg = timeline_segments(marks)
        assert list(seg) == [row for row, _m, _f in TIMELINE]
        assert sum(v is None for v in seg.values()) == skipped
        last = "checkpoint" if "checkpoint" in marks else "first_metric"
        assert sum(v for v in seg.values() if v is not None) == marks[last]
    assert timeline_segments(one)["import torch and the loop"] == 0.75  # from "driver": no gang ranks
    assert timeline_segments(gang)["dataset load"] == 0.25  # from "group"
    assert timeline_segments(trainer)["loop set up (restore, DDP wrap; TorchTrainer: all)"] == 1.0


@pytest.mark.slow
def test_decisions_quick(results: Path) -> None:
    sizes = Sizes(queued=60, users=3, active=4, decide_repeats=3)
    service_bench.main(["--quick", "--parts", "decide"], sizes=sizes)
    body = _load(results / "service.json")
    assert body["parts"] == ["decide"] and set(body["verdicts"]) == {"decisions"}
    d = body["decisions"]
    assert d["queued"] == 60 and d["active"] == 4 and d["users"] == 3
    for part in (d["pure"], d["scheduler"]):
        assert part["starts"] + part["waiting"] == 60 and part["median_s"] > 0
    s = d["scheduler"]
    assert s["queued_in_redis"] == 60 and s["active_in_redis"] == 4 and s["same_as_cold"] is True
    assert d["pure"]["starts"] == s["starts"]  # same inputs, same decision, in memory or through Redis
    for key in ("cold_s", "p99_s", "redis_reads_median_s", "uncached_median_s", "publish_median_s"):
        assert s[key] > 0


@pytest.mark.slow
def test_submissions_and_sse_quick(results: Path) -> None:
    sizes = Sizes(concurrency=[1, 2], submit_seconds=0.5, followers=3, events_per_s=20.0, sse_seconds=1.0,
                  connect_batch=2)
    service_bench.main(["--quick", "--parts", "submit", "sse"], sizes=sizes)
    body = _load(results / "service.json")
    assert set(body["verdicts"]) == {"submissions", "sse"}
    rows = body["submissions"]["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["submitted"] > 0 and r["errors"] == {} and r["p50_s"] <= r["p99_s"] <= r["max_s"]
        assert {"api_cpu_s", "redis_cpu_s", "loadgen_cpu_s", "wall_s"} <= r["cpu"].keys()
    assert set(body["sse"]) == {"storm", "ramped", "api_log_errors", "meets_floor"}
    for mode, batch in (("storm", 3), ("ramped", 2)):
        sse = body["sse"][mode]
        assert sse["connect_batch"] == batch
        assert sse["followers"] == sse["connected"] == sse["followers_complete"] == 3
        assert sse["events"] == 20 and sse["samples"] == 60
        assert sse["missing_events"] == sse["duplicates"] == sse["not_ended"] == 0 and sse["every_event_delivered"]
