"""What a preflight found (``workers.preflight``): a job that runs the user's code is first tried on one CPU.

It imports the factories (or the own loop's entrypoint), builds model and data, runs one forward and backward on a
small batch and one teleport on it; the job joins the queue for its gang only once its verdict is ``passed``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api_schemas.spec import ExperimentSpec

PreflightState = Literal["waiting", "running", "passed", "failed", "stopped"]  # stopped: the job was cancelled


class PreflightLayer(BaseModel):
    """One weight teleport may move: input dimension d, kept rank k, free directions d - k at the spec's tau."""

    model_config = ConfigDict(extra="ignore")

    name: str
    kind: str
    input_dim: int
    rank: int
    free: int


class PreflightResult(BaseModel):
    """The verdict and what was measured on the way (absent what the run never reached)."""

    model_config = ConfigDict(extra="ignore")

    state: PreflightState
    error: str | None = Field(None, description="one line naming the user's file:line and the error")
    seconds: float | None = Field(None, description="how long the preflight's own work took (not Ray's start)")
    wall_seconds: float | None = Field(None, description="from its submit to Ray to its verdict, as the scheduler "
                                                         "saw it (Ray's start, the runtime env and the imports too)")
    entrypoint: str | None = Field(None, description="an own loop: the function checked (imported, one argument)")
    params: int | None = Field(None, description="the model's parameter count")
    task: str | None = None
    train_size: int | None = None
    test_size: int | None = None
    sample_shape: list[int] | None = Field(None, description="the shape of one training input x")
    loss: float | None = Field(None, description="the loss of the forward pass on the small batch")
    teleport: str | None = Field(None, description="the method tried, or null when teleport is off")
    tau: float | None = None
    free_directions: int | None = Field(None, description="free directions over all layers at the spec's tau")
    layers: list[PreflightLayer] = Field(default_factory=list, description="the layers teleport may move")
    untouched: dict[str, str] = Field(default_factory=dict,
                                      description="parameter -> why teleport leaves it as it is")
    grad_norm_sq: float | None = Field(None, description="‖∇L‖² of a teleport batch at the model's first weights")
    grad_norm_sq_after_step: float | None = Field(None, description="the same after one step at teleport.lr (or .rise)")
    step_advice: str | None = Field(None, description="what that step says of teleport.cap and the step size, in a "
                                                      "line: over the cap, a rise too small to matter, or the rise")




def preflight_of(data: dict[str, str]) -> PreflightResult | None:
    """A job hash's preflight as the API shows it (the scheduler's copy of the verdict, or where it stands); None
    for a job that runs no code of the user's. A malformed copy shows as its state alone."""
    state = data.get("preflight") or ""
    if not state:
        if data.get("state") != "queued":
            return None
        try:
            uses = ExperimentSpec.model_validate_json(data.get("spec") or "").user_code_fields()
        except ValueError:
            uses = []
        if not uses:
            return None
        state = "waiting"
    raw = data.get("preflight_result")
    if raw:
        try:
            return PreflightResult.model_validate_json(raw)
        except ValueError:
            pass
    return PreflightResult(state=state if state in ("waiting", "running", "passed", "failed", "stopped") else "running")
