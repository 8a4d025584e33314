"""Benchmark smoke tests write their result JSON into a temp folder, never benchmarks/results/."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture()
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BENCH_RESULTS_DIR", str(tmp_path))
    return tmp_path
