"""The one error body every 4xx of the REST API carries (validation and domain errors alike).

>>> ErrorBody.model_validate({"detail": "training.epochs: too many", "errors": [
...     {"field": "training.epochs", "message": "too many"}]}).errors[0].field
'training.epochs'
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FieldError(BaseModel):
    """One thing wrong with the request, and where."""

    model_config = ConfigDict(extra="forbid")

    field: str = Field(..., description="where: a dotted field path (`spec.training.epochs`), a parameter or header "
                                        "name (`id`, `Idempotency-Key`), or '' for the request as a whole")
    message: str = Field(..., description="what is wrong and what to do, in one line")


class ErrorBody(BaseModel):
    """``{"detail": "field: message; ...", "errors": [{"field", "message"}]}``: ``detail`` is one line a CLI can
    print; ``errors`` the same, one entry per problem, for a client that points at the field."""

    model_config = ConfigDict(extra="forbid")

    detail: str = Field(..., description="the errors in one line: `field: message; ...`")
    errors: list[FieldError] = Field(..., min_length=1, description="one entry per problem, in order")
