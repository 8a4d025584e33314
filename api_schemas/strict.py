"""The base of every spec model: unknown fields are refused (a typo fails with its field's path), and an assignment
is validated like a construction."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
