"""Request count and latency per route template, for ``/metrics``."""

from __future__ import annotations

import time
from typing import Any

from service.deps import State


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
