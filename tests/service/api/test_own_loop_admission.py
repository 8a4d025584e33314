"""An own loop at submit (API only, no Ray): ``training.entrypoint`` is user code (refused where user code is
off, 403 naming it), and a malformed one is a 422 naming the field."""

from __future__ import annotations

import pytest

from tests.service.conftest import Api, tiny


def own_loop(entrypoint: str = "own_loop.loop:train") -> dict:
    spec = tiny(teleport={"enabled": False})
    spec["training"] = {**spec.get("training", {}), "entrypoint": entrypoint, "entrypoint_args": {"width": 8}}
    return spec


@pytest.mark.parametrize("api_env", [{"TLAB_USER_CODE": "off"}])
def test_an_own_loop_is_user_code(api_only: Api) -> None:
    with api_only.client() as c:
        r = c.post("/v1/experiments", json={"spec": own_loop()})
        assert r.status_code == 403 and r.json()["errors"][0]["field"] == "spec.code"
        assert "training.entrypoint" in r.json()["detail"]


def test_a_malformed_entrypoint_is_refused_naming_the_field(api_only: Api) -> None:
    with api_only.client() as c:
        r = c.post("/v1/experiments", json={"spec": own_loop("own_loop/loop.py")})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "spec.training.entrypoint", r.text
        assert c.post("/v1/experiments", json={"spec": own_loop()}).status_code == 201
