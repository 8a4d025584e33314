"""The notebook client (``tlab``) against the real API, without Ray (jobs stay queued): objects for jobs, the one
typed error with its status and field, DataFrames, and a job's TensorBoard files through the API (written here as the
scheduler's tracker writes them, read back with TensorBoard's own reader)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import tlab
from service.core.tensorboard_files import write_job
from tests.service.conftest import TINY, Api


def test_jobs_as_objects_and_one_typed_error(api_only: Api) -> None:
    with tlab.connect(api_only.url, token=api_only.stack.admin_token) as lab:
        check_jobs_and_errors(lab)
    with pytest.raises(tlab.ApiError) as unreachable, tlab.connect("http://127.0.0.1:9", token="x") as nowhere:
        nowhere.experiments()
    assert unreachable.value.status == 0 and "tlab up" in unreachable.value.detail


def check_jobs_and_errors(lab: tlab.Client) -> None:
    run = lab.submit(TINY, set={"training.epochs": 3}, name="queued", tags=["nb"])
    assert run.state == "queued" and run["spec"]["training"]["epochs"] == 3
    assert [e.id for e in lab.experiments(tag="nb")] == [run.id]
    assert run.metrics().empty and run.summary is None
    table = lab.compare([run.id])
    assert table.loc[run.id, "name"] == "queued" and table.loc[run.id, "state"] == "queued"
    assert run.cancel().state == "cancelled"

    with pytest.raises(tlab.ApiError) as refused:
        lab.submit({**TINY, "training": {"epochs": 0}})
    assert refused.value.status == 422 and refused.value.field == "spec.training.epochs"
    assert refused.value.errors[0]["field"] == "spec.training.epochs"
    with pytest.raises(tlab.ApiError) as missing:
        lab.experiment("01JNOSUCHJOB0000000000000")
    assert missing.value.status == 404


def test_tensorboard_files_through_the_api(api_only: Api, tmp_path: Path) -> None:
    records = [{"kind": "epoch", "epoch": e, "train_loss": 1.0 / (e + 1), "seconds": e + 1.0} for e in range(3)]
    with tlab.connect(api_only.url, token=api_only.stack.admin_token) as lab:
        run = lab.submit(TINY)
        write_job(api_only.stack.home / "tensorboard" / run.id, records, start=1000.0)
        folder = run.tensorboard(tmp_path / "tb")
        acc = EventAccumulator(str(folder))
        acc.Reload()
        assert [s.step for s in acc.Scalars("loss/train")] == [0, 1, 2]
        assert lab.tensorboard([run.id], tmp_path / "tb") == tmp_path / "tb"  # again: the older copy replaced
