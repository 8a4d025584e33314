"""The OpenAPI tells the truth about errors, and the API answers as it says: every 4xx is an ErrorBody.

The document is read from the app in-process (fast); what it promises is checked over real HTTP on the API alone
(``api_only``: real Redis, no Ray).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from api_schemas.errors import ErrorBody
from service.api.app import create_app
from service.core.settings import Settings
from tests.service.conftest import Api, tiny

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
# Starlette's FileResponse answers a Range it cannot serve itself, in plain text (documented as such)
PLAIN_RANGE_ERRORS = {("get", "/v1/experiments/{job_id}/artifacts/{name}"),
                      ("get", "/v1/sweeps/{sweep_id}/artifacts/{name}")}


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    return create_app(Settings()).openapi()


def operations(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method, path, op) for path, ops in doc["paths"].items() for method, op in ops.items()]


def test_every_4xx_is_an_error_body(openapi: dict[str, Any]) -> None:
    assert "HTTPValidationError" not in json.dumps(openapi)  # FastAPI's 422 model: a body this API never sends
    assert openapi["components"]["schemas"]["ErrorBody"]["required"] == ["detail", "errors"]
    seen = set()
    for method, path, op in operations(openapi):
        for code, response in op["responses"].items():
            if not code.startswith("4"):
                continue
            seen.add(code)
            if (method, path) in PLAIN_RANGE_ERRORS and code in ("400", "416"):
                assert list(response["content"]) == ["text/plain"], (method, path, code)
                continue
            assert response["content"] == {"application/json": {"schema": ERROR_REF}}, (method, path, code)
    assert {"401", "403", "404", "409", "413", "422", "429"} <= seen


def test_each_route_documents_the_errors_it_can_return(openapi: dict[str, Any]) -> None:
    for method, path, op in operations(openapi):
        codes = set(op["responses"])
        if path.startswith("/v1/"):
            assert "401" in codes and "WWW-Authenticate" in op["responses"]["401"]["headers"], (method, path)
        if "{job_id}" in path or "{sweep_id}" in path:
            assert {"403", "404"} <= codes, (method, path)
        if "requestBody" in op:
            assert {"413", "422"} <= codes, (method, path)
        if method == "post" and path in ("/v1/experiments", "/v1/sweeps"):
            assert {"409", "429"} <= codes and "Retry-After" in op["responses"]["429"]["headers"]
        if "422" in codes:  # only where something can be invalid: a body, a query or header parameter, a file name
            assert ("requestBody" in op or any(p["in"] != "path" for p in op.get("parameters", []))
                    or path.endswith("/artifacts/{name}")), (method, path)


def test_cancel_is_a_post_and_delete_removes_an_ended_job(openapi: dict[str, Any]) -> None:
    for path in ("/v1/experiments/{job_id}", "/v1/sweeps/{sweep_id}"):
        cancel = openapi["paths"][f"{path}/cancel"]["post"]
        assert cancel["summary"].startswith("Cancel") and "stays readable" in cancel["summary"]
        assert "ended" in cancel["responses"]["409"]["description"]
        delete = openapi["paths"][path]["delete"]
        assert delete["summary"].startswith("Delete an ended") and "204" in delete["responses"]
        assert "cancel it first" in delete["responses"]["409"]["description"]


def error_of(r: httpx.Response, status: int) -> ErrorBody:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    return ErrorBody.model_validate(r.json())


def test_the_api_answers_as_documented(api_only: Api) -> None:
    api_only.add_user("bob")
    with api_only.client("bob") as bob, api_only.client("nobody") as anon:
        assert error_of(anon.get("/v1/me"), 401) and anon.get("/v1/me").headers["WWW-Authenticate"] == "Bearer"
        assert error_of(bob.get("/v1/users"), 403).errors[0].field == "Authorization"
        assert error_of(bob.get("/v1/experiments/00000000000-000000"), 404).errors[0].field == "id"
        # the JSON types the schema promises, not pydantic's lax coercions: 0 is no boolean, "2" no integer
        bad = {"spec": tiny(training={"epochs": "2"})}
        assert error_of(bob.post("/v1/experiments", json=bad), 422).errors[0].field == "spec.training.epochs"
        assert error_of(bob.post("/v1/experiments", content=b"\xff\xfe{",
                                 headers={"Content-Type": "application/json"}), 422).errors[0].field == "body"
        options = bob.options("/v1/users")  # 405 names every method of the path, not only the first route's
        assert error_of(options, 405) and options.headers["Allow"] == "GET, POST"
    with api_only.client() as admin:
        assert error_of(admin.patch("/v1/users/bob", json={"disabled": 0}), 422).errors[0].field == "disabled"
        err = error_of(admin.patch("/v1/users/bob", json={"quotas": {"max_gpus": "2"}}), 422)
        assert err.errors[0].field == "quotas.max_gpus"
        assert admin.patch("/v1/users/bob", json={"quotas": {"max_gpus": 2}}).json()["quotas"]["max_gpus"] == 2
        # an integral number is an integer to JSON Schema: 5.0 is fine where an integer is asked for
        r = admin.patch("/v1/users/bob", json={"quotas": {"max_queued_jobs": 5.0}})
        assert r.status_code == 200 and r.json()["quotas"]["max_queued_jobs"] == 5
        r = admin.post("/v1/experiments", params={"dry_run": "true"}, json={"spec": tiny(training={"epochs": 2.0})})
        assert r.status_code == 200 and r.json()["fits_ever"], r.text


def test_cancel_keeps_the_record_and_delete_removes_it_with_its_files(api_only: Api, redis_server: str) -> None:
    import redis

    r = redis.Redis.from_url(redis_server, decode_responses=True)
    api_only.add_user("carol")
    api_only.add_user("dave")
    storage, outside = api_only.stack.home / "storage", api_only.stack.home / "outside.txt"
    outside.write_text("not the job's")
    sweep = {"base": tiny(), "search_space": {"teleport.lr": {"loguniform": [0.01, 1]}}, "num_samples": 2}
    with api_only.client("carol") as c, api_only.client("dave") as other:
        for route, body in (("/v1/experiments", {"spec": tiny()}), ("/v1/sweeps", sweep)):
            job = c.post(route, json=body).json()["id"]
            assert "cancel it first" in error_of(c.delete(f"{route}/{job}"), 409).detail  # queued: not ended
            assert error_of(other.post(f"{route}/{job}/cancel"), 403).errors[0].field == "id"
            cancelled = c.post(f"{route}/{job}/cancel")
            assert cancelled.status_code == 202 and cancelled.json()["state"] == "cancelled"
            got = c.get(f"{route}/{job}")
            assert got.status_code == 200, got.text
            view = got.json()["job"] if route == "/v1/sweeps" else got.json()
            assert view["state"] == "cancelled" and view["finished_at"] is not None
            assert job in [j["id"] for j in c.get(route, params={"state": "cancelled"}).json()["items"]]
            again = error_of(c.post(f"{route}/{job}/cancel"), 409)
            assert "already ended (cancelled)" in again.detail
            # what a run leaves: a checkpoint, an artifact, a log, and a link out of storage (never followed)
            for rel in ("checkpoint_1/checkpoint.pt", "artifacts/model.safetensors", "logs/attempt-1/driver.log"):
                (storage / job / rel).parent.mkdir(parents=True, exist_ok=True)
                (storage / job / rel).write_bytes(b"x" * 100)
            (storage / job / "artifacts" / "link").symlink_to(outside)
            assert error_of(other.delete(f"{route}/{job}"), 403).errors[0].field == "id"
            deleted = c.delete(f"{route}/{job}")
            assert deleted.status_code == 204 and deleted.content == b""
            assert error_of(c.get(f"{route}/{job}"), 404) and error_of(c.delete(f"{route}/{job}"), 404)
            assert job not in [j["id"] for j in c.get(route).json()["items"]]
            assert not (storage / job).exists() and outside.read_text() == "not the job's"
            assert r.keys(f"tlab:job:{job}*") == [] and r.zscore("tlab:jobs", job) is None




def test_the_schema_carries_the_patterns_and_content_types_the_server_checks(openapi: dict[str, Any]) -> None:
    from api_schemas.code import FACTORY_PATTERN, LOSS_PATTERN
    from service.api.events import STREAM_ID_PATTERN
    from service.api.routes.logs import CURSOR_PATTERN

    # Last-Event-ID wherever it is read: a string of the pattern the route checks (never null: a header is absent)
    for path, pattern in (("/v1/experiments/{job_id}/events", STREAM_ID_PATTERN),
                          ("/v1/sweeps/{sweep_id}/events", STREAM_ID_PATTERN),
                          ("/v1/experiments/{job_id}/logs/stream", CURSOR_PATTERN)):
        header = next(p for p in openapi["paths"][path]["get"]["parameters"] if p["name"] == "last-event-id")
        assert header["schema"]["type"] == "string" and header["schema"]["pattern"] == pattern, header
    schemas = openapi["components"]["schemas"]
    assert schemas["CustomModel"]["properties"]["factory"]["pattern"] == FACTORY_PATTERN
    training = json.dumps(schemas["TrainingSpec"]["properties"])
    assert json.dumps(LOSS_PATTERN) in training and json.dumps(FACTORY_PATTERN) in training  # loss, entrypoint
    assert list(openapi["paths"]["/v1/code"]["post"]["requestBody"]["content"]) == ["application/zip"]
