"""What one teleport did: losses and ‖∇L‖² before/after, steps, time, and what each layer could move."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class LayerReport:
    """One weight (or the rows of it that share their uses, e.g. a conv group): input dim d, kept rank k,
    free directions d − k."""

    name: str
    kind: str
    input_dim: int
    rank: int
    free: int
    captured_variance: float


@dataclass
class TeleportReport:
    loss_before: float
    loss_after: float
    grad_norm_sq_before: float
    grad_norm_sq_after: float
    steps: int
    backoffs: int
    stop_reason: str  # "steps" | "cap" | "loss_tol" | "no_ascent" | "not_finite" | "no_free_directions"
    seconds: float
    method: str = "nullspace"
    layers: list[LayerReport] = field(default_factory=list)
    untouched: dict[str, str] = field(default_factory=dict)  # parameter name -> why it stays as it is
    heldout_loss_before: float | None = None
    heldout_loss_after: float | None = None
    ascent: str = "host"  # how the steps ran: "host", "device" or "cuda_graph" (``TeleportConfig.ascent``)
    hvp: str = "exact"  # how H·∇L was computed (``TeleportConfig.hvp``)
    graph_replayed: bool = False  # "cuda_graph": the model's graph from an earlier batch served this one

    @property
    def free_directions(self) -> int:
        return sum(layer.free for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
