"""``Client``: the REST API as Python objects (the CLI, the notebook and the tests use this one client).

>>> import tlab
>>> lab = tlab.connect()                                   # TLAB_URL/TLAB_TOKEN, else the local `tlab up`
>>> run = lab.submit("mnist_mlp", set={"training.epochs": 3}).wait()   # doctest: +SKIP
>>> run.metrics()[["train_loss", "test_loss"]]                          # doctest: +SKIP
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlab.http import ApiError, Event, Http
from tlab.runs import Experiment, Sweep, frame

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

SpecLike = Mapping[str, Any] | str | Path  # a spec as data, a YAML/JSON file, or a preset name


def load_spec(spec: Any, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A spec as JSON data: a dict (or a pydantic model) as it is, a path or preset name read the way the CLI reads
    it; ``overrides`` (dotted path -> value) set on top. The API validates it (an ``ApiError`` names the field)."""
    if hasattr(spec, "model_dump"):
        data = spec.model_dump(mode="json")
    elif isinstance(spec, Mapping):
        data = copy.deepcopy(dict(spec))  # ``set`` never changes the caller's dict
    else:
        from api_schemas.spec_io import load_spec_data

        try:
            data = load_spec_data(str(spec))
        except ValueError as err:  # SpecError: no such file or preset, or not YAML/JSON
            raise ApiError(0, str(err), field="spec") from None
    for path, value in (overrides or {}).items():
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data


class Client(Http):
    """One connection to the API. Experiments and sweeps come back as objects with their own methods.

    >>> lab = tlab.Client("http://127.0.0.1:8470", token="...")   # doctest: +SKIP
    >>> [e.id for e in lab.experiments(state="running")]          # doctest: +SKIP
    """

    # ---- experiments ---------------------------------------------------------------------------
    def submit(self, spec: Any, *, code: str | Path | None = None, set: Mapping[str, Any] | None = None,
               name: str = "", priority: int = 0, tags: list[str] | None = None,
               idempotency_key: str | None = None) -> Experiment:
        """Queue an experiment: ``spec`` a dict, a YAML/JSON file or a preset name; ``code`` your package's
        directory (zipped, uploaded once, set as ``code.package``); ``set`` dotted overrides."""
        from tlab.code_zip import with_code

        data, _ = with_code(self, load_spec(spec, set), code)
        return Experiment(self, self.submit_json(data, name, priority, tags, idempotency_key))

    def submit_json(self, spec: dict[str, Any], name: str = "", priority: int = 0, tags: list[str] | None = None,
                    idempotency_key: str | None = None) -> dict[str, Any]:
        """``POST /v1/experiments`` as JSON: the job's view."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body = {"spec": spec, "name": name, "priority": priority, "tags": tags or []}
        return self.json("POST", "/v1/experiments", json=body, headers=headers)

    def experiment(self, job_id: str) -> Experiment:
        """An experiment by id (an ``ApiError`` 404 if it is not yours or not there)."""
        return Experiment(self, self.get(job_id))

    def experiments(self, state: str | None = None, tag: str | None = None, limit: int | None = None
                    ) -> list[Experiment]:
        """Your experiments, newest first."""
        return [Experiment(self, v) for v in self.list(state=state, tag=tag, limit=limit)]

    def get(self, job_id: str) -> dict[str, Any]:
        return self.json("GET", f"/v1/experiments/{job_id}")

    def list(self, **params: Any) -> list[dict[str, Any]]:
        return self.json("GET", "/v1/experiments", params={k: v for k, v in params.items() if v is not None})["items"]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self.json("POST", f"/v1/experiments/{job_id}/cancel")

    def delete(self, job_id: str) -> None:
        """Delete an ended experiment or sweep with everything it left (its id answers 404 afterwards)."""
        self.request("DELETE", f"/v1/experiments/{job_id}")

    def plot(self, job_ids: list[str], x: str = "both") -> bytes:
        """The service's PNG of these runs' curves."""
        params = {"compare": ",".join(job_ids[1:])} if len(job_ids) > 1 else {}
        if x != "epoch":
            params["x"] = x
        return self.request("GET", f"/v1/experiments/{job_ids[0]}/plot.png", params=params).content

    def events(self, job_id: str, last_id: str | None = None, reconnect: bool = True) -> Iterator[Event]:
        """The job's events until ``end``; on a dropped connection it reconnects with ``Last-Event-ID``."""
        return self.stream(f"/v1/experiments/{job_id}/events", last_id, reconnect)

    def logs(self, job_id: str, rank: str = "0", tail: int | None = None, attempt: int | None = None) -> str:
        """What the rank printed, as kept in storage (``GET .../logs``)."""
        params = {"rank": rank} | ({"tail": tail} if tail is not None else {}) | (
            {"attempt": attempt} if attempt is not None else {})
        return self.request("GET", f"/v1/experiments/{job_id}/logs", params=params).text

    def follow_logs(self, job_id: str, rank: str = "0", last_id: str | None = None) -> Iterator[Event]:
        """The rank's log as ``log`` events (data: the new lines) until the job has ended, then ``end``."""
        return self.stream(f"/v1/experiments/{job_id}/logs/stream?rank={rank}", last_id, True, decode=str)

    # ---- sweeps --------------------------------------------------------------------------------
    def sweep(self, base: Any, search_space: Mapping[str, Mapping[str, Any]], *, code: str | Path | None = None,
              set: Mapping[str, Any] | None = None, **options: Any) -> Sweep:
        """Queue a sweep over ``search_space`` (dotted path -> ``{"grid": [...]}``, ``{"loguniform": [lo, hi]}``...)
        around ``base``; ``options`` are the rest of ``POST /v1/sweeps`` (``num_samples``, ``metric``, ``mode``,
        ``scheduler``, ``searcher``, ``max_concurrent_trials``, ``name``, ``tags``...)."""
        from tlab.code_zip import with_code

        data, _ = with_code(self, load_spec(base, set), code)
        body = {"base": data, "search_space": dict(search_space), **options}
        return Sweep(self, self.json("POST", "/v1/sweeps", json=body))

    def sweep_by_id(self, sweep_id: str) -> Sweep:
        return Sweep(self, self.json("GET", f"/v1/sweeps/{sweep_id}"))

    # ---- several runs --------------------------------------------------------------------------
    def compare(self, job_ids: list[str]) -> pd.DataFrame:
        """One row per experiment: its name, state, epochs and every figure of its summary (final losses, accuracy,
        seconds, teleport time...), indexed by id."""
        rows = []
        for job_id in job_ids:
            v = self.get(job_id)
            rows.append({"id": job_id, "name": v["name"], "state": v["state"],
                         "epochs": (v.get("progress") or {}).get("epoch"), **flat_summary(v.get("summary"))})
        return frame(rows).set_index("id")

    def job(self, job_id: str) -> Experiment | Sweep:
        """An experiment or a sweep by id, whichever it is."""
        view = self.get(job_id)
        return self.sweep_by_id(job_id) if view.get("kind") == "sweep" else Experiment(self, view)

    def tensorboard(self, job_ids: list[str], directory: str | Path = "tensorboard") -> Path:
        """The TensorBoard files of these experiments and sweeps, one run directory each under ``directory``."""
        for job_id in job_ids:
            self.job(job_id).tensorboard(directory)
        return Path(directory)

    def compare_figure(self, job_ids: list[str], x: str = "both") -> Figure:
        """A matplotlib figure of these runs' train/test losses (teleports marked): ``x`` ``epoch``, ``seconds``
        (wall clock, teleport time included) or ``both``."""
        from plots.curves import curves_figure

        runs: dict[str, list[dict[str, Any]]] = {}
        for job_id in job_ids:
            name = self.get(job_id)["name"] or job_id
            runs[name if name not in runs else f"{name} ({job_id})"] = self.experiment(job_id).records()
        return curves_figure(runs, x=x)


def flat_summary(summary: Mapping[str, Any] | None) -> dict[str, Any]:
    """A job's summary with only its plain values (numbers, text, flags): nested reports stay out of a table."""
    return {k: v for k, v in (summary or {}).items() if isinstance(v, int | float | str | bool) or v is None}
