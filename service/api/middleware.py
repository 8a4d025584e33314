"""Pure ASGI middleware: request count and latency per route template (``/metrics``); the body cap (413)."""

from __future__ import annotations

import json
import time
from typing import Any

from service.api.deps import State
from service.api.http_errors import error_body


class Measure:
    """Pure ASGI middleware: request count and latency (to the response start) per route template."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                st: State | None = getattr(scope["app"].state, "tlab", None)
                if st is not None:
                    path = getattr(scope.get("route"), "path", "unmatched")
                    st.requests.labels(scope["method"], path, str(message["status"])).inc()
                    st.latency.labels(path).observe(time.perf_counter() - t0)
            await send(message)

        await self.app(scope, receive, send_wrapper)


class BodyTooLarge(Exception):
    """Raised by the counting ``receive`` once a body passes the cap; ``BodyLimit`` answers 413."""


class BodyLimit:
    """Pure ASGI middleware: a 413 for a request body over ``max_bytes``, before it is read whole.

    A ``Content-Length`` over the cap is refused before the app runs (nothing of the body is read); a chunked
    body is counted as it arrives and refused at the first chunk past the cap. Paths under ``exempt`` (code
    uploads, which have their own cap) are let through.
    """

    def __init__(self, app: Any, max_bytes: int, exempt: tuple[str, ...] = ("/v1/code",)) -> None:
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self.exempt):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self.refuse(send)
            return
        seen, over, started = 0, False, False

        async def counting_receive() -> dict[str, Any]:
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                over = True
                raise BodyTooLarge
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal started
            if over:  # the app turned BodyTooLarge into its own error response: answer 413 instead
                if not started and message["type"] == "http.response.start":
                    started = True
                    await self.refuse(send)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            if not started:
                await self.refuse(send)

    async def refuse(self, send: Any) -> None:
        limit = self.max_bytes
        body = json.dumps(error_body([{"field": "body", "message": (
            f"the request body is over this service's limit of {limit} bytes ({limit / 2**20:g} MiB, "
            "TLAB_MAX_BODY_BYTES): send less")}])).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
