"""A small HTTP client for the REST API (the CLI, the demo and the tests use it): JSON in, JSON out,
errors as one line with the field path, and a Server-Sent Events reader that resumes where it stopped."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from service.core.settings import default_home


class ApiError(RuntimeError):
    """A non-2xx answer, as the one line the API put in ``detail``."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


@dataclass(frozen=True)
class Event:
    id: str
    kind: str
    data: Any  # a JSON event's object, or a log event's text


def home() -> Path:
    return Path(os.environ.get("TLAB_HOME") or default_home())


def default_url() -> str:
    """``TLAB_URL``, else the URL the local ``tlab up`` wrote, else the default port."""
    if os.environ.get("TLAB_URL"):
        return os.environ["TLAB_URL"]
    written = home() / "api.url"
    return written.read_text().strip() if written.exists() else "http://127.0.0.1:8470"


def default_token() -> str:
    if os.environ.get("TLAB_TOKEN"):
        return os.environ["TLAB_TOKEN"]
    written = home() / "admin.token"
    return written.read_text().strip() if written.exists() else ""


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = (url or default_url()).rstrip("/")
        token = default_token() if token is None else token
        self.http = httpx.Client(base_url=self.url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.ConnectError:
            raise ApiError(0, f"cannot reach {self.url}: start the service with `tlab up`, or set TLAB_URL") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ApiError(r.status_code, str(detail))
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return self.request(method, path, **kw).json()

    # ---- experiments ---------------------------------------------------------------------------
    def submit(self, spec: dict[str, Any], name: str = "", priority: int = 0, tags: list[str] | None = None,
               idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body = {"spec": spec, "name": name, "priority": priority, "tags": tags or []}
        return self.json("POST", "/v1/experiments", json=body, headers=headers)

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

    def stream(self, path: str, last_id: str | None, reconnect: bool,
               decode: Callable[[str], Any] | None = None) -> Iterator[Event]:
        """An SSE route's events until ``end``; on a dropped connection it reconnects with ``Last-Event-ID``.
        ``decode`` reads each event's data (default JSON)."""
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                with self.http.stream("GET", path, headers=headers, timeout=httpx.Timeout(30.0, read=60.0)) as r:
                    if r.status_code >= 400:
                        r.read()
                        raise ApiError(r.status_code, str(r.json().get("detail", r.text)))
                    for event in parse_sse(r.iter_lines(), decode or json.loads):
                        last_id = event.id or last_id
                        yield event
                        if event.kind == "end":
                            return
            except (httpx.TransportError, httpx.RemoteProtocolError):
                if not reconnect:
                    raise
                time.sleep(1.0)


def parse_sse(lines: Iterator[str], decode: Callable[[str], Any] = json.loads) -> Iterator[Event]:
    """Events from SSE lines (``id:``, ``event:``, ``data:``; comments and ``retry:`` skipped); ``decode`` reads
    an event's data (JSON, or ``str`` for a log's lines)."""
    eid, kind, data = "", "message", []
    for line in lines:
        if not line:
            if data:
                yield Event(eid, kind, decode("\n".join(data)))
            eid, kind, data = "", "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "id":
                eid = value
            elif name == "event":
                kind = value
            elif name == "data":
                data.append(value)
