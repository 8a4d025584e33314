"""How errors look on the wire: one JSON shape, field paths first, for validation and domain errors alike.

The HTTP status of each domain error is its class's ``status`` (``service/errors.py``); this module is the one
place that turns them into responses.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from service.errors import ServiceError, TooManyRequests

# location parts that say where a value came from or which union member was tried, not which field it is
_NOT_FIELDS = ("body", "query", "header", "path", "mlp", "cnn", "resnet", "transformer")


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(p) for p in loc if p not in _NOT_FIELDS)


def error_body(errors: list[dict[str, str]]) -> dict[str, Any]:
    """``{"detail": "field: message; ...", "errors": [{"field", "message"}]}``: one line a CLI can print."""
    detail = "; ".join(f"{e['field']}: {e['message']}" if e.get("field") else e["message"] for e in errors)
    return {"detail": detail, "errors": errors}


async def on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [{"field": _loc(e.get("loc", ())), "message": str(e.get("msg", "")).removeprefix("Value error, ")}
              for e in exc.errors()]
    return JSONResponse(error_body(errors), status_code=422)


async def on_service_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    if isinstance(exc, TooManyRequests):
        headers = {"Retry-After": str(exc.retry_after_s)}
    return JSONResponse(error_body([{"field": exc.field or "", "message": exc.message}]), status_code=exc.status,
                        headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ServiceError, on_service_error)
