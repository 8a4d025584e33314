"""The scheduler's tracker threads: TensorBoard files for every job, and MLflow runs when an admin names a server.

A thread per writer (``service.core.tensorboard_files``; with ``TLAB_MLFLOW_TRACKING_URI`` set,
``service.scheduler.mlflow_runs``): every ``TRACK_S`` it looks at the jobs that are starting or running, and at those
it saw running that have since ended (once more, then no longer); at its start, at the newest ``BACKFILL`` jobs (an
ended one whose files a stopped scheduler did not finish). For each whose stream moved it reads the job's records and
hands them to its writer.
Both take the records as data (numbers by epoch, deduplicated) and are safe to repeat. A writer that fails (MLflow down)
is logged, once per kind of error, and tried again on the next pass; a tick of the scheduler never waits for it, nor
does the other writer.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from api_schemas import gate, keys
from api_schemas.jobs import TrialRow
from service.core import tensorboard_files
from service.core.settings import Settings
from service.core.store import Store
from service.scheduler.repeated import RepeatedErrors

log = logging.getLogger(__name__)
TRACK_S = 2.0
BACKFILL = 100
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
Records = list[dict[str, Any]]
Trials = dict[str, dict[str, Any]] | None  # a sweep's trials table; None for an experiment


class Trackers:
    """``start()`` a daemon thread per writer (TensorBoard; MLflow with a server named: a slow or down server never
    holds the TensorBoard files back), or call ``sync(job_id)`` (tests: every writer, in this thread)."""

    def __init__(self, store: Store, settings: Settings, period_s: float = TRACK_S) -> None:
        self.store, self.settings, self.period_s = store, settings, period_s
        self.uri = settings.mlflow_tracking_uri
        self.mlflow: Any = None  # imported on first use: MLflow takes seconds to import
        self.writers: dict[str, Callable[[str, dict[str, str], Records, Trials, str | None], None]] = {
            "tensorboard": self.tensorboard, **({"mlflow": self.mlflow_run} if self.uri else {})}
        self.seen: dict[str, dict[str, tuple[str, str]]] = {w: {} for w in self.writers}  # job -> (last id, state)
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.quiet = RepeatedErrors(log)

    def start(self) -> Trackers:
        for writer in self.writers:
            thread = threading.Thread(target=self.loop, args=(writer,), name=f"tlab-{writer}", daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=10)

    def loop(self, writer: str) -> None:
        backfill = list(self.store.r.zrange(keys.jobs(), -BACKFILL, -1))
        while not self.stopping.is_set():
            for job_id in sorted(set(backfill) | self.store.r.smembers(keys.active()) | self.watched(writer)):
                try:
                    self.sync(job_id, writer)
                except Exception as err:  # a writer or MLflow failed: said once per kind, tried on the next pass
                    self.quiet.report(err)
            backfill = []
            self.stopping.wait(self.period_s)

    def watched(self, writer: str) -> set[str]:
        """The jobs last seen not ended: one more pass each after they end."""
        return {j for j, (_, state) in self.seen[writer].items() if state not in TERMINAL}

    def sync(self, job_id: str, only: str | None = None) -> None:
        """Hand what is new of the job to each writer (``only``: that one) that has not seen it yet."""
        job = self.store.r.hgetall(keys.job(job_id))
        writers = [only] if only else list(self.writers)
        if not job or "state" not in job:
            for w in writers:
                self.seen[w].pop(job_id, None)
            return
        last = self.store.r.xrevrange(keys.events(job_id), count=1)
        mark = (last[0][0] if last else "", job["state"])
        writers = [w for w in writers if self.seen[w].get(job_id) != mark]
        if not writers:
            return
        records = self.records(job_id)
        trials = self.trials(job_id) if job.get("kind") == "sweep" else None
        ended = job["state"] if job["state"] in TERMINAL else None
        for w in writers:
            self.writers[w](job_id, job, records, trials, ended)
            self.seen[w][job_id] = mark

    def tensorboard(self, job_id: str, job: dict[str, str], records: Records, trials: Trials, ended: str | None
                    ) -> None:
        start = float(job.get("started_at") or job.get("created_at") or 0.0)
        tensorboard_files.write_job(tensorboard_files.directory(self.settings, job_id), records, start, trials, ended)

    def mlflow_run(self, job_id: str, job: dict[str, str], records: Records, trials: Trials, ended: str | None
                   ) -> None:
        if self.mlflow is None:
            from service.scheduler.mlflow_runs import Tracking

            self.mlflow = Tracking(self.uri)
        self.mlflow.sync({**job, "id": job_id}, records, trials, self.settings.storage_path if ended else None)

    def records(self, job_id: str) -> Records:
        out = []
        for _id, fields in self.store.events(job_id):
            try:
                data = json.loads(fields.get("data", "{}"))
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict) and data.get("kind") in ("epoch", "teleport"):
                out.append(data)
        return out

    def trials(self, sweep_id: str) -> dict[str, dict[str, Any]]:
        """The sweep's trials table (the driver writes it: each row validated, a malformed one left out)."""
        rows = {}
        for raw in self.store.r.hgetall(keys.trials(sweep_id)).values():
            try:
                row = TrialRow.model_validate_json(raw)
                gate.trial_id(row.trial)  # a directory's name below the job's
            except ValueError:  # gate.Refused too
                continue
            rows[row.trial] = row.model_dump()
        return rows
