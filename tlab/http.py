"""The wire: where the API is, the one error type, and a Server-Sent Events reader that resumes where it stopped.

>>> from tlab.http import Http
>>> api = Http("http://127.0.0.1:8470", token="...")   # doctest: +SKIP
>>> api.json("GET", "/v1/me")["name"]                  # doctest: +SKIP
'admin'
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8470"


class ApiError(RuntimeError):
    """What went wrong, in one line: ``status`` (the HTTP status; 0 when the API was not reached or a download did
    not check out), ``field`` (the first field path the API named, '' for the request as a whole), ``detail`` (the
    API's one line) and ``errors`` (every ``{"field", "message"}`` it listed).

    >>> try:
    ...     tlab.connect().submit({"training": {"epochs": -1}})   # doctest: +SKIP
    ... except tlab.ApiError as err:
    ...     print(err.status, err.field)                           # 422 spec.training.epochs
    """

    def __init__(self, status: int, detail: str, field: str = "", errors: list[dict[str, str]] | None = None) -> None:
        super().__init__(f"HTTP {status}: {detail}" if status else detail)
        self.status, self.detail, self.field = status, detail, field
        self.errors = errors or ([{"field": field, "message": detail}] if detail else [])

    @classmethod
    def from_response(cls, r: httpx.Response) -> ApiError:
        """The API's error body (``{"detail", "errors": [{"field", "message"}]}``) or, from a proxy, its text."""
        try:
            body = r.json()
        except ValueError:
            return cls(r.status_code, r.text.strip() or r.reason_phrase)
        if not isinstance(body, dict):
            return cls(r.status_code, str(body))
        errors = [e for e in body.get("errors") or [] if isinstance(e, dict)]
        return cls(r.status_code, str(body.get("detail", r.text)), str(errors[0].get("field", "")) if errors else "",
                   errors)


@dataclass(frozen=True)
class Event:
    """One Server-Sent Event: ``id`` (the stream id a follow resumes after), ``kind`` (``metric``, ``teleport``,
    ``status``, ``log``, ``end``...) and ``data`` (a JSON event's object, or a log event's text)."""

    id: str
    kind: str
    data: Any = field(default=None)

    @property
    def epoch(self) -> int | None:
        """The epoch a ``metric`` or ``teleport`` event is about (0-based), else None."""
        return self.data.get("epoch") if isinstance(self.data, dict) else None


def local_home() -> Path:
    """``TLAB_HOME``, else where ``tlab up`` keeps its files: ``~/.tlab`` (``/var/lib/tlab`` for root)."""
    if os.environ.get("TLAB_HOME"):
        return Path(os.environ["TLAB_HOME"])
    return Path("/var/lib/tlab") if os.geteuid() == 0 else Path("~/.tlab").expanduser()


def default_url() -> str:
    """``TLAB_URL``, else the URL the local ``tlab up`` wrote, else the default port."""
    if os.environ.get("TLAB_URL"):
        return os.environ["TLAB_URL"]
    written = local_home() / "api.url"
    return written.read_text().strip() if written.exists() else DEFAULT_URL


def default_token() -> str:
    """``TLAB_TOKEN``, else the local ``tlab up``'s admin token, else none."""
    if os.environ.get("TLAB_TOKEN"):
        return os.environ["TLAB_TOKEN"]
    written = local_home() / "admin.token"
    return written.read_text().strip() if written.exists() else ""


class Http:
    """JSON in, JSON out over one connection pool; every non-2xx answer is an ``ApiError``."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = (url or default_url()).rstrip("/")
        token = default_token() if token is None else token
        self.http = httpx.Client(base_url=self.url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.ConnectError:
            raise ApiError(0, f"cannot reach {self.url}: start the service with `tlab up`, or set TLAB_URL") from None
        if r.status_code >= 400:
            raise ApiError.from_response(r)
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return self.request(method, path, **kw).json()

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
                        raise ApiError.from_response(r)
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
