"""MLflow tracking from the trusted side: with ``TLAB_MLFLOW_TRACKING_URI`` set, the scheduler logs each job to
that server (docs/tracking.md). The job's code never sees the URI nor MLflow's credentials (``MLFLOW_TRACKING_*`` in
the scheduler's environment): they stay out of every Ray node's environment (``service.stack.embedded.job_safe``).

One run per experiment (a sweep: a parent run, one nested run per trial), found again by its ``tlab.job`` tag, so a
restarted scheduler goes on with the same run. Its params are the spec's fields (dotted paths); its metrics the
epochs' values (``step = epoch``, the tags of ``service.core.tensorboard_files.scalars``), logged in batches whose
last epoch is recorded in the same call (the ``tlab.logged_epoch`` tag): an epoch is logged once, across a kill -9 of
the job and its resume, and across a restart of the scheduler. Once the job has ended: its summary, its artifacts
(regular files, read without following a link) and the run's end status.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from service.core import safe_files
from service.core.tensorboard_files import Records, by_trial, number, scalars

log = logging.getLogger(__name__)
JOB_TAG, LOGGED, FINAL = "tlab.job", "tlab.logged_epoch", "tlab.final"
BATCH = 900  # MLflow takes at most 1000 metrics per log_batch call
MAX_PARAMS = 90  # ... and 100 params
ARTIFACT_MAX_BYTES = 512 << 20
STATUS = {"succeeded": "FINISHED", "stopped early": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}


def flat(data: Any, prefix: str = "") -> dict[str, str]:
    """A spec as dotted paths -> text (MLflow params are strings of at most 6000 characters)."""
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for k, v in data.items():
            out |= flat(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): json.dumps(data)[:6000] if not isinstance(data, str) else data[:6000]}


class Tracking:
    """The MLflow side of the scheduler's tracker (``service.scheduler.trackers``)."""

    def __init__(self, uri: str) -> None:
        self.client = MlflowClient(tracking_uri=uri)
        self.runs: dict[tuple[str, str], Any] = {}  # (job, trial) -> its MLflow run (last read)

    def experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name)

    def run(self, job: dict[str, str], trial: str, parent: str | None, params: dict[str, str]) -> Any:
        """The job's (or trial's) run: the one tagged with it, else a new one with its params."""
        key = (job["id"], trial)
        if key in self.runs:
            return self.runs[key]
        ident = f"{job['id']}/{trial}" if trial else job["id"]
        exp = self.experiment_id(job.get("name") or "teleport-lab")
        found = self.client.search_runs([exp], filter_string=f"tags.`{JOB_TAG}` = '{ident}'", max_results=1)
        if found:
            run = found[0]
        else:
            tags = {JOB_TAG: ident, "tlab.owner": job.get("owner", ""), LOGGED: "-1"}
            if parent:
                tags["mlflow.parentRunId"] = parent
            run = self.client.create_run(exp, run_name=trial or job.get("name") or job["id"], tags=tags,
                                         start_time=int(float(job.get("started_at") or time.time()) * 1000))
            items = sorted(params.items())[:MAX_PARAMS]
            self.client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in items])
            run = self.client.get_run(run.info.run_id)
        self.runs[key] = run
        return run

    def log_epochs(self, run: Any, epochs: Records, teleports: Records, start: float) -> int:
        """The epochs after the run's ``tlab.logged_epoch``, in batches that each record their last epoch."""
        done = int(run.data.tags.get(LOGGED, "-1"))
        metrics: list[Metric] = []
        last = done
        for e in epochs:
            if e["epoch"] <= done:
                continue
            wall = int((start + (float(e["seconds"]) if number(e.get("seconds")) else 0.0)) * 1000)
            values = scalars(e, teleports)
            if metrics and len(metrics) + len(values) > BATCH:
                self.client.log_batch(run.info.run_id, metrics=metrics, tags=[RunTag(LOGGED, str(last))])
                metrics = []
            metrics += [Metric(k, v, wall, e["epoch"]) for k, v in sorted(values.items())]
            last = e["epoch"]
        if metrics:
            self.client.log_batch(run.info.run_id, metrics=metrics, tags=[RunTag(LOGGED, str(last))])
        run.data.tags[LOGGED] = str(last)
        return last - done

    def finish(self, run: Any, state: str, summary: dict[str, Any] | None, files: list[tuple[Path, str]]) -> None:
        """The ended job's summary (numbers as metrics, the whole as summary.json), artifacts and end status."""
        if run.data.tags.get(FINAL):
            return
        rid = run.info.run_id
        if summary:
            self.client.log_dict(rid, summary, "summary.json")
            plain = [Metric(f"summary/{k}", float(v), int(time.time() * 1000), 0)
                     for k, v in summary.items() if number(v)]
            if plain:
                self.client.log_batch(rid, metrics=plain[:BATCH])
        for path, where in files:
            self.client.log_artifact(rid, str(path), where or None)
        self.client.set_tag(rid, FINAL, state)
        self.client.set_terminated(rid, STATUS.get(state, "FAILED"))
        run.data.tags[FINAL] = state

    def sync(self, job: dict[str, str], records: Records, trials: dict[str, dict[str, Any]] | None,
             storage: str | None) -> None:
        """Log what is new of ``job`` (its hash's fields); ``storage`` (the storage root) once it has ended."""
        start = float(job.get("started_at") or job.get("created_at") or time.time())
        spec = json.loads(job.get("spec") or "{}")
        runs = by_trial(records)
        ended = job.get("state") if job.get("state") in STATUS else None
        if trials is None:
            run = self.run(job, "", None, flat(spec))
            epochs, teleports = runs.get("", ([], []))
            self.log_epochs(run, epochs, teleports, start)
            if ended and storage is not None:
                summary = json.loads(job["summary"]) if job.get("summary") else None
                self.finish(run, ended, summary, artifact_files(storage, job["id"]))
            return
        parent = self.run(job, "", None, flat({"base": spec}))
        for trial, row in sorted(trials.items()):
            run = self.run(job, trial, parent.info.run_id, flat(row.get("config") or {}))
            epochs, teleports = runs.get(trial, ([], []))
            self.log_epochs(run, epochs, teleports, start)
            if ended:
                self.finish(run, str(row.get("state") or ended), row.get("summary"), [])
        if ended and storage is not None:
            self.finish(parent, ended, json.loads(job["summary"]) if job.get("summary") else None, [])


def artifact_files(storage: str, job_id: str) -> list[tuple[Path, str]]:
    """The job's artifacts that are regular files under its directory, no link followed, each under the bound, as
    (path, folder in the run's artifacts)."""
    out = []
    try:
        for name, st in safe_files.files(storage, f"{job_id}/artifacts"):
            if st.st_size <= ARTIFACT_MAX_BYTES:
                folder = str(Path(name).parent)
                out.append((Path(storage) / job_id / "artifacts" / name, "" if folder == "." else folder))
    except (FileNotFoundError, NotADirectoryError, safe_files.UnsafeFile):
        return []
    return out
