"""The error responses routes document, in one place: every 4xx is an ``ErrorBody`` (``api_schemas.errors``).

Routers and routes combine the shared dicts by what they take (``responses=OWNED | SUBMIT``): a bearer token
(``AUTHED``: 401), a job or sweep id in the path (``OWNED``: 403, 404), a JSON body (``BODY``: 413, 422), a
submit (``SUBMIT``: 409, 429 too). ``document_errors`` then makes the app's OpenAPI say so: each 4xx gets the
ErrorBody schema, and FastAPI's own 422 (``HTTPValidationError``, a body this API never sends) becomes an
ErrorBody where the operation has a parameter or body that can be invalid, and goes where it has none.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from api_schemas.errors import ErrorBody

ERROR_REF = "#/components/schemas/ErrorBody"
JSON_ERROR = {"application/json": {"schema": {"$ref": ERROR_REF}}}
FASTAPI_422 = "#/components/schemas/HTTPValidationError"
Responses = dict[int | str, dict[str, Any]]


def header(description: str) -> dict[str, Any]:
    """A response header that is always sent."""
    return {"description": description, "required": True, "schema": {"type": "string"}}


def error(description: str, **headers: dict[str, Any]) -> dict[str, Any]:
    """An error response: ``description``, the ErrorBody schema, and the headers it always carries."""
    out: dict[str, Any] = {"description": description, "content": JSON_ERROR}
    if headers:
        out["headers"] = {name.replace("_", "-"): h for name, h in headers.items()}
    return out


RETRY_AFTER = header("seconds to wait before trying again")
AUTHED: Responses = {401: error("no bearer token, or an unknown, rotated or disabled one",
                                WWW_Authenticate=header("`Bearer`"))}
ADMIN: Responses = {403: error("only an admin may do this")}
OWNED: Responses = {403: error("the experiment or sweep belongs to another user"),
                    404: error("no such experiment or sweep (or the id is not one)")}
LISTED: Responses = {403: error("`owner` names another user: only an admin may list others' jobs")}
USER: Responses = {404: error("no such user")}
BODY: Responses = {413: error("the body is over TLAB_MAX_BODY_BYTES"),
                   422: error("a field is invalid, or the body is not JSON: `errors[].field` names it")}
SUBMIT: Responses = BODY | {
    403: error("the spec runs user code (a package, a factory, a loss function) and user code is off for this "
               "service (TLAB_USER_CODE=off) or for you (can_submit_code)"),
    409: error("the Idempotency-Key was used before with another body"),
    422: error("an invalid spec or search space, a model that cannot take the data, data missing or outside the "
               "data roots, over a service limit or a quota, or a gang that can never fit the cluster"),
    429: error("max_queued_jobs reached: try again after Retry-After seconds", Retry_After=RETRY_AFTER),
}
STREAMS: Responses = {429: error("TLAB_MAX_STREAMS_PER_USER event streams of yours, or TLAB_MAX_STREAMS of "
                                 "everyone's, open in this API process: close one, or try again after Retry-After "
                                 "seconds", Retry_After=RETRY_AFTER)}


def _can_be_invalid(operation: dict[str, Any]) -> bool:
    """An operation with a body, or a query or header parameter, can answer 422; path ids alone cannot (they are
    plain strings: a wrong one is a 404)."""
    return "requestBody" in operation or any(p.get("in") != "path" for p in operation.get("parameters", []))


def truthful(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (an OpenAPI document) with every 4xx an ErrorBody, and FastAPI's 422 model gone."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    body = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(body.pop("$defs", {}))
    components["ErrorBody"] = body
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            responses = operation.get("responses", {})
            fastapi_422 = responses.get("422", {}).get("content", {}).get("application/json", {}).get("schema")
            if fastapi_422 == {"$ref": FASTAPI_422}:
                if _can_be_invalid(operation):
                    responses["422"] = error("a parameter is invalid: `errors[].field` names it")
                else:
                    del responses["422"]
            for code, response in responses.items():
                if code.startswith("4") and "content" not in response:
                    response["content"] = JSON_ERROR
    return schema


def document_errors(app: FastAPI) -> None:
    """Make ``app``'s ``/openapi.json`` say what its errors look like (see ``truthful``)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = truthful(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
