"""How errors look on the wire: one JSON shape (``api_schemas.errors.ErrorBody``), field paths first, for
validation, domain and framework errors alike (a 404 for an unknown path, a 405, a body that is not UTF-8).

The HTTP status of each domain error is its class's ``status`` (``service/core/errors.py``); this module is the one
place that turns them into responses, and ``service/api/responses.py`` documents them in the OpenAPI.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from api_schemas.errors import ErrorBody
from api_schemas.spec import DATASET_TAGS
from service.api.responses import document_errors
from service.core.errors import ServiceError, TooManyRequests

FASTAPI_UNDECODABLE = "There was an error parsing the body"  # fastapi.routing's 400 for a body it cannot decode
# location parts that say where a value came from or which union member was tried, not which field it is
_NOT_FIELDS = ("body", "query", "header", "path", "mlp", "cnn", "resnet", "transformer", "custom", *DATASET_TAGS)


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(p) for p in loc if p not in _NOT_FIELDS)


def error_body(errors: list[dict[str, str]]) -> dict[str, Any]:
    """``{"detail": "field: message; ...", "errors": [{"field", "message"}]}``: one line a CLI can print."""
    detail = "; ".join(f"{e['field']}: {e['message']}" if e.get("field") else e["message"] for e in errors)
    return ErrorBody.model_validate({"detail": detail, "errors": errors}).model_dump()


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


METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (Starlette's own 405 names only the first route's): those for
    which a route matches the request fully."""
    routes = request.app.router.routes
    return ", ".join(m for m in METHODS
                     if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes))


async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's and FastAPI's own errors in the same shape, their headers kept (``Allow`` on a 405 naming every
    method of the path). A body FastAPI cannot decode (not UTF-8) is a 422 like any other body that is not JSON."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 400 and exc.detail == FASTAPI_UNDECODABLE:
        return JSONResponse(error_body([{"field": "body", "message": "the body is not UTF-8 JSON: send JSON"}]),
                            status_code=422)
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request)
        message = f"{request.method} is not served here: use {headers['Allow']}"
    else:
        message = str(exc.detail)
    return JSONResponse(error_body([{"field": "", "message": message}]), status_code=exc.status_code,
                        headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Every error as an ErrorBody, and the OpenAPI saying so."""
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(HTTPException, on_http_error)
    document_errors(app)
