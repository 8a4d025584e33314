"""JSON bodies read as strictly as their JSON Schema says: ``0`` is no boolean, ``"5"`` no integer.

FastAPI validates a body in pydantic's lax Python mode, which coerces (``"disabled": 0`` becomes False,
``"epochs": "10"`` becomes 10), while the OpenAPI promises the JSON types. A route that takes a body adds
``dependencies=[Depends(strict_json(Model))]``: after the caller is authenticated, the body is validated once more
in pydantic's strict JSON mode (enum values as strings, integers for floats and arrays for tuples stay fine; an
integral number such as ``5.0`` counts as an integer, as in JSON Schema) and a mismatch is a 422 like any other
invalid field. FastAPI's own validation still gives the route its argument.
"""

import json
import math
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from api_schemas.jobs import UserPublic
from service.api.deps import current_user


def _number(text: str) -> float | int:
    """A JSON number with a fraction or exponent; an integral one (``16264.0``) is an integer to JSON Schema, so
    it is one here too (strict pydantic would refuse it for an ``int``)."""
    value = float(text)
    return int(value) if math.isfinite(value) and value.is_integer() else value


def strict_json(model: type[BaseModel], caller: Callable[..., UserPublic] = current_user
                ) -> Callable[..., Awaitable[None]]:
    """A dependency: 422 unless the request's body is a ``model`` in strict JSON mode, checked after ``caller``
    (the route's own auth dependency: a 401 or 403 comes first); an empty body is left to FastAPI, which names
    the missing field."""

    # no `from __future__ import annotations` here: FastAPI must see this annotation as an object (`caller` is local)
    async def check(request: Request, _user: Annotated[Any, Depends(caller)]) -> None:
        raw = await request.body()
        if not raw:
            return
        try:
            data = json.loads(raw, parse_float=_number)
        except ValueError:
            return  # not JSON (or not UTF-8): FastAPI's own validation says so
        try:
            model.model_validate_json(json.dumps(data), strict=True)
        except ValidationError as err:
            raise RequestValidationError(err.errors(include_url=False)) from None

    return check
