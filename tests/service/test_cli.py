"""The ``tlab`` console script, as a user runs it: a subprocess, exit codes, stderr messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TLAB = str(Path(sys.executable).parent / "tlab")


def tlab(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TLAB, *args], capture_output=True, text=True, timeout=240, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})


def test_help_lists_the_commands() -> None:
    out = tlab("--help")
    assert out.returncode == 0
    for command in ("run", "compare", "presets", "validate"):
        assert f"\n    {command} " in out.stdout
    bare = tlab()
    assert bare.returncode == 2 and "COMMAND" in bare.stderr


def test_presets_and_validate_are_handed_to_the_workers_cli() -> None:
    presets = tlab("presets")
    assert presets.returncode == 0
    assert "digits/teleport" in presets.stdout and "paper/mnist-sgd" in presets.stdout
    valid = tlab("validate", "digits/teleport", "--set", "teleport.tau=0.95")
    assert valid.returncode == 0 and "tau: 0.95" in valid.stdout
    assert tlab("run", "--help").stdout.startswith("usage: tlab run")


def test_a_bad_override_exits_2_naming_the_field(tmp_path: Path) -> None:
    out = tlab("run", "digits/teleport", "--local", "--out", str(tmp_path / "run"), "--set", "teleport.tau=3",
               "training.epochs=0")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert any(line.startswith("error: teleport.tau:") for line in lines)
    assert any(line.startswith("error: training.epochs:") for line in lines)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_run_on_ray_writes_the_same_outputs_as_local(tmp_path: Path) -> None:
    """`tlab run --ray` starts a local Ray cluster, trains with 2 DDP workers, and writes the local files."""
    out = tlab("run", "digits/teleport", "--ray", "--out", str(tmp_path / "r"), "--set", "training.epochs=2",
               "dataset.max_train=200", "teleport.batches=1", "teleport.steps=2", "resources.workers=2",
               "resources.cpus_per_worker=0.5", env={"RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines if r["kind"] == "epoch"] == [0, 1]
    assert sum(r["kind"] == "teleport" for r in lines) == 2
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["spec"]["resources"]["workers"] == 2
    assert (tmp_path / "r" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_dataset_files_exit_2_with_the_loader_message(tmp_path: Path) -> None:
    out = tlab("run", "paper/mnist-sgd", "--local", "--no-progress", "--out", str(tmp_path / "run"),
               "--set", f"dataset.root={tmp_path / 'nowhere'}")
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: dataset mnist") and "nowhere" in last and "dataset.root" in last
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()  # nothing started: no empty run directory left behind


@pytest.mark.slow
def test_run_local_with_overrides_writes_the_outputs(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    out = tlab("run", "digits/teleport", "--local", "--no-progress", "--out", str(out_dir), "--set",
               "training.epochs=2", "dataset.max_train=200", "dataset.max_test=100", "model.hidden=[16]",
               "teleport.batches=2", "teleport.steps=2", "teleport.epochs=[1]")
    assert out.returncode == 0, out.stderr
    assert "train loss" in out.stdout and "metrics.jsonl" in out.stdout
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]
    assert [(r["epoch"], r["batch"]) for r in records if r["kind"] == "teleport"] == [(1, 0), (1, 1)]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["spec"]["model"]["hidden"] == [16] and summary["spec"]["dataset"]["max_train"] == 200
    assert (out_dir / "curves.png").stat().st_size > 10_000
