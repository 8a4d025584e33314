"""The ``tlab`` commands that start Ray, as a user runs them: ``run --ray``, ``up``, ``demo``, and ``submit --follow``
of a job on the session's stack; and the slow ``run --local`` (a Ray chain of ``tests/conftest.py``, which runs slow
tests there too; the others are in ``test_cli``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.service.cli.tlab_process import tlab


@pytest.mark.slow
def test_run_on_ray_with_code_writes_the_same_outputs_as_local(tmp_path: Path) -> None:
    """`tlab run --ray --code DIR` starts a local Ray cluster, sends DIR to the workers as Ray's working_dir (the
    example's factories and loss import there, not only in this process), trains with 2 DDP workers, and writes
    the local files."""
    example = Path(__file__).resolve().parents[3] / "examples" / "tiny_lm"
    out = tlab("run", str(example / "spec.yaml"), "--ray", "--code", str(example), "--out", str(tmp_path / "r"),
               "--set", "training.epochs=2", "training.max_steps_per_epoch=4", "dataset.args.max_chars=6000",
               "teleport.epochs=[0]", "teleport.batches=1", "teleport.steps=2", "teleport.batch_size=2",
               "teleport.budget=null", "resources.workers=2", "resources.cpus_per_worker=0.5", cwd=tmp_path,
               env={"RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["dataset"] for r in lines if r["kind"] == "start"] == ["tiny_lm.data:python_source"]
    assert [r["epoch"] for r in lines if r["kind"] == "epoch"] == [0, 1]
    assert sum(r["kind"] == "teleport" for r in lines) == 1
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["epochs"] == 2 and summary["spec"]["resources"]["workers"] == 2 and summary["final_test_ppl"] > 1
    assert (tmp_path / "r" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_submit_follow_runs_to_the_end(stack, tmp_path: Path) -> None:  # noqa: ANN001
    env = {"TLAB_URL": stack.url, "TLAB_TOKEN": stack.admin_token, "TLAB_HOME": str(tmp_path)}
    spec = tmp_path / "tiny.yaml"
    spec.write_text("dataset: {name: digits}\nmodel: {kind: mlp, hidden: [32]}\ntraining: {epochs: 3}\n"
                    "teleport: {enabled: false}\n")
    out = tlab("submit", str(spec), "--follow", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].endswith("succeeded") and "3/3" in out.stderr
    assert "running" in out.stderr  # the status changes, as they happened
    # into a pipe: one plain line per epoch, no progress bar redrawn with carriage returns
    assert "\r" not in out.stderr and "\x1b[" not in out.stderr, out.stderr
    assert [line.split(" epoch ")[1].split()[0] for line in out.stderr.splitlines() if " epoch " in line] == [
        "1/3", "2/3", "3/3"], out.stderr


@pytest.mark.slow
def test_tlab_up_prints_its_url_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    import time

    import httpx
    import psutil

    from tests.service.conftest import tlab_up
    from tests.service.stack.conftest import passable_home

    # (GPUs advertised only; as root, Ray runs as the service user, who must reach the home: not pytest's 0700 tmp)
    with passable_home() as home, tlab_up(home, "--num-cpus", "1", "--num-gpus", "2") as (proc, url, _printed):
        token = (home / "admin.token").read_text().strip()
        assert (home / "api.url").read_text().strip() == url
        me = httpx.get(f"{url}/v1/me", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert me.status_code == 200 and me.json()["role"] == "admin"
        deadline = time.monotonic() + 30  # the scheduler reports the Ray node it found
        while time.monotonic() < deadline and httpx.get(f"{url}/readyz", timeout=10).status_code != 200:
            time.sleep(0.3)
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        deadline = time.monotonic() + 30  # ready may come a tick before the scheduler's first view of the nodes
        while "GPUs 2 free of 2" not in (cluster := tlab("cluster", env={
                "TLAB_URL": url, "TLAB_TOKEN": token, "TLAB_HOME": str(home)})).stdout and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "GPUs 2 free of 2" in cluster.stdout and "GPU MODEL" in cluster.stdout, cluster.stdout
        # the node's memory Ray may reserve (resources.memory_gb), read from the real head: free/total in GiB
        assert re.search(r"MEMORY GIB FREE/TOTAL.*\n.* (\d+\.\d)/\1 ", cluster.stdout), cluster.stdout
        assert re.search(r"memory (\d+\.\d) GiB free of \1", cluster.stdout), cluster.stdout
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis" in names and "raylet" in names and "service.api" in names and "service.scheduler" in names
    assert proc.returncode == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/healthz", timeout=5)
    _gone, alive = psutil.wait_procs(children, timeout=10)  # the stack's processes, each waited for, not a nap
    assert [c for c in alive if c.status() != psutil.STATUS_ZOMBIE] == []


@pytest.mark.slow
def test_demo_end_to_end_in_a_pipe_says_seconds_and_epochs_without_cursor_codes(tmp_path: Path) -> None:
    """`tlab demo` (what `make demo` runs; here 3 epochs, 1 seed) into a pipe, as CI or a log reads it: one plain
    line per epoch of each run, the two runs of a seed side by side yet never glued into one line, no tqdm cursor
    codes; its verdict and its figures (demo.json); curves.png."""
    out = tlab("demo", "--home", str(tmp_path / "demo"), "--epochs", "3", "--seeds", "1",
               env={"RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "\x1b[" not in out.stdout + out.stderr and "\r" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if re.search(r" epoch \d+/3 ", line)]
    # every epoch of each run once (a fresh-clone run under load once counted 21 of 20 when two followers' threads
    # printed side by side), and one run's line never glued to the other's
    for run in ("with teleport s0", "without teleport s0"):
        assert sorted(re.search(r" epoch (\d)/3 ", line).group(1) for line in lines if line.startswith(run + " ")) \
            == ["1", "2", "3"], "\n".join(out.stderr.splitlines()[-80:])
    assert all(line.count(" epoch ") == 1 for line in lines), "\n".join(lines)
    assert "the paper's MNIST/SGD row on digits" in out.stdout
    verdict = next(line for line in out.stdout.splitlines() if line.startswith(("teleport", "no verdict")))
    assert "% of its runs" in verdict, out.stdout
    figures = json.loads((tmp_path / "demo" / "demo.json").read_text())
    assert figures["seeds"] == 1 and figures["verdict"] == verdict and set(figures["runs"]) == {
        "with teleport s0", "without teleport s0"}
    assert (tmp_path / "demo" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_run_local_with_overrides_writes_the_outputs(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    out = tlab("run", "digits/teleport", "--local", "--no-progress", "--out", str(out_dir), "--set",
               "training.epochs=2", "dataset.max_train=200", "dataset.max_test=100", "model.hidden=[16]",
               "teleport.batches=2", "teleport.steps=2", "teleport.epochs=[1]", "teleport.budget=null")
    assert out.returncode == 0, out.stderr
    assert "train loss" in out.stdout and "metrics.jsonl" in out.stdout
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]
    teleports = [(r["epoch"], r["batch"], r["steps"], r["stop_reason"]) for r in records if r["kind"] == "teleport"]
    assert [t[:2] for t in teleports] == [(1, b) for b in range(len(teleports))]  # teleport.epochs=[1], in order
    # a batch that cannot move (at CAP, no free direction: hidden [16] under a batch of 32) ends the epoch's teleport
    assert len(teleports) == 2 or teleports[-1][2:] in ((0, "cap"), (0, "no_free_directions"))
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["spec"]["model"]["hidden"] == [16] and summary["spec"]["dataset"]["max_train"] == 200
    assert (out_dir / "curves.png").stat().st_size > 10_000


@pytest.mark.drill
def test_a_demo_killed_mid_run_stops_its_whole_stack(tmp_path: Path) -> None:
    """`kill` (SIGTERM) of a running `tlab demo` stops what it started, as Ctrl-C does: no Redis, Ray, API, scheduler
    or job of its stack is left running."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    from tests.service.cli.tlab_process import TLAB

    home = tmp_path / "demo"
    with (tmp_path / "demo.log").open("w") as log:
        demo = subprocess.Popen([TLAB, "demo", "--home", str(home), "--seeds", "1"], stdout=log, stderr=log,
                                env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    deadline = time.monotonic() + 180
    while " epoch 2/" not in (tmp_path / "demo.log").read_text():  # its runs are training
        assert demo.poll() is None and time.monotonic() < deadline, (tmp_path / "demo.log").read_text()[-2000:]
        time.sleep(0.5)
    started = {p.pid for p in psutil.Process(demo.pid).children(recursive=True)}
    assert started
    demo.send_signal(signal.SIGTERM)
    assert demo.wait(timeout=120) != 0

    def left() -> list[str]:
        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if p.info["pid"] in started or str(home) in " ".join(p.info["cmdline"] or []) or \
                        p.environ().get("TLAB_HOME") == str(home):
                    out.append(" ".join(p.info["cmdline"] or [])[:120])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    deadline = time.monotonic() + 30  # (Ray's workers end a moment after their raylet)
    while (still := left()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not still, still
