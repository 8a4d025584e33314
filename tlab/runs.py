"""``Experiment`` and ``Sweep``: one job each, as a notebook handles it.

>>> run = lab.submit("mnist_mlp")            # doctest: +SKIP
>>> for event in run.follow():               # typed events; a second follow() goes on where this one stopped
...     print(event.kind, event.epoch)
>>> run.wait().summary["final_test_loss"]    # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlab.http import ApiError, Event

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from tlab.client import Client

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


def frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame.from_records(rows)


class Job:
    """What an experiment and a sweep share: an id, the view last read, waiting, following, cancelling."""

    route = "experiments"

    def __init__(self, client: Client, view: dict[str, Any]) -> None:
        self.client = client
        self.view = view
        self.id: str = view["id"]
        self.last_event_id: str | None = None  # follow() goes on after it

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, name={self.view.get('name')!r}, state={self.state!r})"

    def __getitem__(self, key: str) -> Any:
        """A field of the view last read: ``run["state"]``, ``run["progress"]`` (``refresh()`` reads it anew)."""
        return self.view[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.view.get(key, default)

    def refresh(self) -> dict[str, Any]:
        """Read the job's view again (state, progress, summary, failure reason)."""
        self.view = self.client.json("GET", f"/v1/{self.route}/{self.id}")
        return self.view

    @property
    def state(self) -> str:
        return str(self.view["state"])

    @property
    def summary(self) -> dict[str, Any] | None:
        """The final figures (losses, accuracy, times, teleport totals) once the job has ended; None before."""
        if self.view.get("summary") is None and self.state not in TERMINAL:
            self.refresh()
        return self.view.get("summary")

    def wait(self, timeout: float | None = None, poll_s: float = 1.0, check: bool = False) -> Any:
        """Block until the job has ended (``timeout`` seconds at most: then a ``TimeoutError``); ``check``: an
        ``ApiError`` (its status 0) if it did not succeed. Returns the job itself."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.refresh_state() not in TERMINAL:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.id} is still {self.state} after {timeout:g} s")
            time.sleep(poll_s)
        if check and self.state != "succeeded":
            raise ApiError(0, f"{self.id} {self.state}: {self.view.get('failure_reason') or 'no reason given'}")
        return self

    def refresh_state(self) -> str:
        self.refresh()
        return self.state

    def follow(self, from_start: bool = False) -> Iterator[Event]:
        """The job's events until it ends (history first): ``metric``, ``teleport``, ``status``, ``log``, ``end``. A
        broken connection is resumed with ``Last-Event-ID``; so is a second ``follow()`` (``from_start``: all again)."""
        start = None if from_start else self.last_event_id
        for event in self.client.stream(f"/v1/{self.route}/{self.id}/events", start, True):
            self.last_event_id = event.id or self.last_event_id
            yield event

    def cancel(self) -> Any:
        """Stop it (a queued one leaves the queue); its record, metrics and artifacts stay."""
        self.view = self.client.json("POST", f"/v1/{self.route}/{self.id}/cancel")
        return self

    def delete(self) -> None:
        """Delete the ended job and everything it left."""
        self.client.request("DELETE", f"/v1/{self.route}/{self.id}")

    def tensorboard(self, directory: str | Path = "tensorboard") -> Path:
        """Download its TensorBoard event files into ``directory/ID`` (replacing an older copy): point
        ``tensorboard --logdir directory`` (or ``%tensorboard --logdir directory`` in Jupyter) at it."""
        import io
        import shutil
        import tarfile

        data = self.client.request("GET", f"/v1/{self.route}/{self.id}/tensorboard").content
        out = Path(directory)
        shutil.rmtree(out / self.id, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(out, filter="data")  # names stay below ``out``; no links, no devices
        return out / self.id


class Experiment(Job):
    """One experiment. ``metrics()`` and ``teleports()`` are DataFrames; ``continue_()`` and ``fork()`` start new
    experiments from its checkpoints."""

    route = "experiments"

    def records(self, max_points: int | None = None) -> list[dict[str, Any]]:
        """The epoch and teleport records, as the runner wrote them (each epoch once, a parent's first)."""
        params = {"max_points": max_points} if max_points else {}
        got = self.client.json("GET", f"/v1/experiments/{self.id}/metrics", params=params)
        return [*got["points"], *got["teleports"]]

    def metrics(self, max_points: int | None = None) -> pd.DataFrame:
        """One row per epoch, indexed by epoch: train/test loss, accuracy, lr, grad_norm, seconds, teleport_seconds
        and whatever else the run reported (``max_points``: evenly spaced, first and last kept)."""
        params = {"max_points": max_points} if max_points else {}
        got = self.client.json("GET", f"/v1/experiments/{self.id}/metrics", params=params)
        df = frame(got["points"])
        return df.drop(columns=["kind"], errors="ignore").set_index("epoch") if len(df) else df

    def teleports(self) -> pd.DataFrame:
        """One row per teleport batch: epoch, batch, losses and ‖∇L‖² before/after, steps, stop reason, seconds."""
        got = self.client.json("GET", f"/v1/experiments/{self.id}/metrics")
        plain = [{k: v for k, v in t.items() if not isinstance(v, list | dict) and k != "kind"}
                 for t in got["teleports"]]
        return frame(plain)

    def figure(self, x: str = "both") -> Figure:
        """Its train/test loss curves (teleports marked) as a matplotlib figure."""
        from plots.curves import curves_figure

        return curves_figure({self.view.get("name") or self.id: self.records()}, x=x)

    def logs(self, rank: str = "0", tail: int | None = None, attempt: int | None = None) -> str:
        """What a rank printed (``driver``, ``preflight``, a rank number), kept after the job ended."""
        return self.client.logs(self.id, rank, tail, attempt)

    def artifacts(self) -> list[dict[str, Any]]:
        """Its files (weights as safetensors, metrics, what the run saved): name, bytes, sha256."""
        return self.client.json("GET", f"/v1/experiments/{self.id}/artifacts")["items"]

    def pull(self, directory: str | Path | None = None) -> list[Path]:
        """Download its artifacts into ``directory`` (default ./ID), each checked against its listed sha256."""
        from tlab.pull import pull

        return pull(self.client, self.id, Path(directory or self.id))

    def continue_(self, epochs: int, idempotency_key: str | None = None) -> Experiment:
        """A new experiment training ``epochs`` more from this one's final checkpoint (it must have ended)."""
        return self._child("continue", {"epochs": epochs}, idempotency_key)

    def fork(self, from_epoch: int, set: Mapping[str, Any] | None = None,
             idempotency_key: str | None = None) -> Experiment:
        """A new experiment from the checkpoint after ``from_epoch`` with ``set`` (dotted path -> value) changed."""
        return self._child("fork", {"from_epoch": from_epoch, "set": dict(set or {})}, idempotency_key)

    def _child(self, how: str, body: dict[str, Any], idempotency_key: str | None) -> Experiment:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        view = self.client.json("POST", f"/v1/experiments/{self.id}/{how}", json=body, headers=headers)
        return Experiment(self.client, view)


class Sweep(Job):
    """A sweep: ``trials()`` is a DataFrame, one row per trial with its config's values as columns."""

    route = "sweeps"

    def __init__(self, client: Client, view: dict[str, Any]) -> None:
        super().__init__(client, view.get("job", view))  # GET answers {job, trials, best...}, POST the job
        self.detail: dict[str, Any] = view if "job" in view else {}

    def refresh(self) -> dict[str, Any]:
        self.detail = self.client.json("GET", f"/v1/sweeps/{self.id}")
        self.view = self.detail["job"]
        return self.view

    def trials(self) -> pd.DataFrame:
        """trial, state, epochs, last and best value of the sweep's metric, stopped early, then one column per
        searched path (``teleport.tau``...) and the trial's summary figures, indexed by trial."""
        self.refresh()
        rows = []
        for t in self.detail["trials"]:
            row = {"trial": t["trial"], "state": t["state"], "epochs": t["epochs"], "last": t.get("last"),
                   "best": t.get("best"), "stopped_early": t.get("stopped_early", False), **t["config"]}
            rows.append(row | {k: v for k, v in (t.get("summary") or {}).items() if k not in row})
        df = frame(rows)
        return df.set_index("trial") if len(df) else df

    @property
    def best(self) -> dict[str, Any] | None:
        """The best trial's row as the API ranks it (the sweep's metric and mode)."""
        if not self.detail:
            self.refresh()
        return self.detail.get("best")

    def study(self) -> dict[str, Any]:
        """Mean ± std per configuration over its trials (seeds), as ``tlab compare`` prints it."""
        return self.client.json("GET", f"/v1/sweeps/{self.id}/study")
