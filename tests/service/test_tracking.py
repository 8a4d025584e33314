"""TensorBoard files and MLflow runs, written by the scheduler from a job's records, after a kill -9 of the job's
driver and its resume from a checkpoint: TensorBoard's own reader finds every epoch once, and a real ``mlflow
server`` (SQLite, started here) holds one run for the job with every epoch's metrics once, its params, summary and
artifacts; the job's processes never see the tracking server's address."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from service.cli import main as tlab
from service.cli.client import Client
from service.stack.embedded import Stack
from tests.conftest import _free_port
from tests.service.conftest import tiny
from tests.service.test_driver_death import driver_of
from tests.service.test_e2e import wait_state

pytestmark = pytest.mark.slow
EPOCHS = 12
MLFLOW_UP_S = 240.0  # a loaded 2-core machine took 77 s for the first start (imports, the SQLite schema)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mlflow server`` on SQLite, on its own process group (its workers stop with it); started here, waited
    for by the test (``up``), so its start overlaps the stack's."""
    where = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    argv = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
            f"sqlite:///{where}/mlflow.db", "--artifacts-destination", str(where / "artifacts"),
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with (where / "server.log").open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def up(url: str) -> None:
    deadline = time.monotonic() + MLFLOW_UP_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"mlflow server at {url} did not answer in {MLFLOW_UP_S:g} s")


@pytest.fixture()
def stack_env(mlflow_server: str) -> dict[str, str]:
    return {"TLAB_MLFLOW_TRACKING_URI": mlflow_server}


def tensorboard_steps(stack: Stack, job: str, out: Path) -> dict[str, list[int]]:
    """`tlab tensorboard JOB --no-start` into ``out``, read with TensorBoard's reader: tag -> its steps."""
    code = tlab(["--url", stack.url, "--token", stack.admin_token, "tensorboard", job, "-o", str(out), "--no-start"])
    assert code == 0
    acc = EventAccumulator(str(out / job))
    acc.Reload()
    return {tag: [s.step for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.drill
def test_every_epoch_once_in_tensorboard_and_mlflow_after_kill9_and_resume(stack: Stack, mlflow_server: str,
                                                                           tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    spec = tiny(training={"epochs": EPOCHS, "batch_size": 2},
                teleport={"enabled": True, "epochs": [1], "batches": 1, "steps": 2, "budget": None})
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(spec, name="tracked")["id"]
        metrics = (e for e in c.events(job) if e.kind == "metric")
        next(itertools.islice(metrics, 5, None))  # the 6th epoch: past TLAB_CHECKPOINT_EVERY_S, a checkpoint is kept
        driver = driver_of(job)
        leaked = sorted(k for k in driver.environ() if "MLFLOW" in k.upper())
        assert not leaked, f"the job's driver sees {leaked}"
        driver.send_signal(signal.SIGKILL)
        view = wait_state(c, job, {"succeeded", "failed", "cancelled"}, timeout=240)
        assert view["state"] == "succeeded" and view["attempts"] == 2, view

    deadline = time.monotonic() + 60  # the tracker's pass after the end (every 2 s)
    while (steps := tensorboard_steps(stack, job, tmp_path / "tb")).get("loss/train") != list(range(EPOCHS)):
        assert time.monotonic() < deadline, steps.get("loss/train")
        time.sleep(1.0)
    for tag in ("loss/test", "accuracy/test", "epoch/seconds", "teleport/share"):
        assert steps[tag] == list(range(EPOCHS)), tag
    assert steps["teleport/grad_norm_sq_before"] == steps["teleport/grad_norm_sq_after"] == [1]

    up(mlflow_server)
    client = MlflowClient(tracking_uri=mlflow_server)
    deadline = time.monotonic() + 240  # the first MLflow import in the scheduler takes seconds (a minute, loaded)
    while True:
        experiment = client.get_experiment_by_name("tracked")
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        if runs and runs[0].info.status == "FINISHED":
            break
        assert time.monotonic() < deadline, [r.info.status for r in runs]
        time.sleep(1.0)
    assert len(runs) == 1 and runs[0].data.tags["tlab.job"] == job
    rid = runs[0].info.run_id
    for key in ("loss/train", "loss/test", "accuracy/test"):
        assert [m.step for m in client.get_metric_history(rid, key)] == list(range(EPOCHS)), key
    assert runs[0].data.params["training.epochs"] == str(EPOCHS)
    names = {a.path for a in client.list_artifacts(rid)}
    assert {"summary.json", "model.safetensors"} <= names, names


def test_a_restarted_tracker_logs_each_epoch_once(redis_server: str, mlflow_server: str, tmp_path: Path) -> None:
    """The stream holds an epoch twice (as a job could write it) and a second tracker starts after the first
    logged part of the run (a restarted scheduler): one run, each epoch once, TensorBoard and MLflow alike."""
    import json

    from mlflow.tracking import MlflowClient

    from api_schemas import keys
    from service.core.settings import Settings
    from service.core.store import Store
    from service.scheduler.trackers import Trackers

    store = Store.from_url(redis_server)
    settings = Settings(redis_url=redis_server, home=tmp_path, mlflow_tracking_uri=mlflow_server)
    job = "01JTRACKERRESTART"
    store.r.hset(keys.job(job), mapping={"state": "running", "name": "restarted", "owner": "ann", "started_at": "1000",
                                         "spec": json.dumps({"training": {"epochs": 4}})})

    def epoch(e: int) -> None:
        store.r.xadd(keys.events(job), {"kind": "metric", "data": json.dumps(
            {"kind": "epoch", "epoch": e, "train_loss": 1.0 / (e + 1), "seconds": e + 1.0})})

    up(mlflow_server)
    for e in (0, 1, 1):
        epoch(e)
    Trackers(store, settings).sync(job)
    for e in (2, 3):
        epoch(e)
    store.r.hset(keys.job(job), mapping={"state": "succeeded", "summary": json.dumps({"final_train_loss": 0.25})})
    again = Trackers(store, settings)  # knows nothing of the first: finds the run by its tag
    again.sync(job)
    again.sync(job)

    client = MlflowClient(tracking_uri=mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("restarted").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss/train")] == [0, 1, 2, 3]
    acc = EventAccumulator(str(tmp_path / "tensorboard" / job))
    acc.Reload()
    assert [s.step for s in acc.Scalars("loss/train")] == [0, 1, 2, 3]


def test_no_mlflow_setting_reaches_a_ray_node() -> None:
    """What a job's processes inherit: none of MLflow's variables, nor the service's tracking URI."""
    from service.stack.embedded import job_safe

    for name in ("TLAB_MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME",
                 "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_S3_ENDPOINT_URL"):
        assert not job_safe(name), name
