"""Smoke runs of the benchmarks that start their own Ray cluster or train for real: each in a subprocess
(one Ray per process), in --quick sizes, checking the result JSON's shape — never the timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_quick(module: str, out: Path) -> dict:
    env = {**os.environ, "BENCH_RESULTS_DIR": str(out), "RAY_AUTH_MODE": "disabled",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--quick"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / f"{module}.json").read_text())


def test_convergence_quick(tmp_path: Path) -> None:
    body = run_quick("convergence", tmp_path)
    assert body["quick"] is True and set(body["table"]) == {"sgd"}
    assert {"teleport", "baseline", "epoch_speedup", "target"} <= set(body["table"]["sgd"])
    assert len(body["runs"]["sgd"]["teleport"]) == 1 and body["runs"]["sgd"]["teleport"][0]["teleport_seconds"] > 0


@pytest.mark.slow
def test_parallel_bases_quick(tmp_path: Path) -> None:
    body = run_quick("parallel_bases", tmp_path)
    assert len(body["rows"]) == 4
    for row in body["rows"]:
        assert set(row["seconds"]) == {"serial", "threads", "ray", "auto"}
        assert all(v > 0 for v in row["seconds"].values()) and min(row["ratio_to_best"].values()) == 1.0


@pytest.mark.slow
def test_ray_overhead_quick(tmp_path: Path) -> None:
    body = run_quick("ray_overhead", tmp_path)
    assert set(body["runs"]) == {"local", "ray", "driver"}
    assert body["per_epoch_ratio"] > 0 and body["runs"]["ray"]["startup"] > 0 and body["job_per_epoch_ratio"] > 0
