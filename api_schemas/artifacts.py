"""The REST contract for a job's artifacts: what ``GET /v1/experiments/{id}/artifacts`` lists."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ArtifactView(BaseModel):
    """One file a job kept: download it from ``/v1/experiments/{id}/artifacts/{name}`` (Range supported)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="path under the job's artifacts directory, '/'-separated")
    bytes: int = Field(..., ge=0)
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$")
    modified_at: float


class ArtifactList(BaseModel):
    """A job's artifacts: model.safetensors, checkpoint.pt, metrics.csv, summary.json, and what its code wrote.
    For a sweep: its best trial's (``trial`` in summary.json)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    items: list[ArtifactView]
