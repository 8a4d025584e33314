"""The REST contract for a job's artifacts: what ``GET /v1/experiments/{id}/artifacts`` lists."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

SUMS = "SHA256SUMS"  # the export's digests, in sha256sum's format: `sha256sum -c SHA256SUMS` checks a pull
HASH_FILE_MAX = 4 << 30  # bytes: a larger file is not hashed at export (SHA256SUMS says so in a comment)
HASH_EXPORT_MAX = 8 << 30  # bytes an export hashes in all; the files past it are not hashed either


class ArtifactView(BaseModel):
    """One file a job kept: download it from ``/v1/experiments/{id}/artifacts/{name}`` (Range supported)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="path under the job's artifacts directory, '/'-separated")
    bytes: int = Field(..., ge=0)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$",
                               description="as recorded in SHA256SUMS when the artifacts were exported; null when "
                                           "none was (sha256_note says why). The API never reads a file to list it")
    sha256_note: str = Field("", description="where sha256 comes from, or why there is none")
    modified_at: float


class ArtifactList(BaseModel):
    """A job's artifacts: model.safetensors, checkpoint.pt, metrics.csv, summary.json, and what its code wrote.
    For a sweep: its best trial's (``trial`` in summary.json)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    items: list[ArtifactView]
