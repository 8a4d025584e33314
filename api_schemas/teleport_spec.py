"""``teleport``: when and how an experiment teleports (a section of ``api_schemas.spec.ExperimentSpec``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from api_schemas.strict import Strict

# the scale-free teleport measured on digits and the char LM (docs/algorithm.md): each batch's ‖∇L‖² raised to about
# twice its own (cap_ratio 2, no absolute CAP) in one step: a rise of 150 % predicted from the step's own slope passes
# ×2, so the step is aimed at 80 % of the way there and an overshoot is shortened to land under it (``guard``); the
# hints suggest it, the benchmarks run it
SCALE_FREE: dict[str, float | None] = {"rise": 1.5, "cap": None, "cap_ratio": 2.0}


class TeleportSpec(Strict):
    """When and how to teleport (paper Algorithm 1; eq. 3 for tau, eq. 5 for the update)."""

    enabled: bool = True
    method: Literal["nullspace", "symmetry"] = "nullspace"
    epochs: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: [0, 1, 2, 3, 4],
        description="teleport before each of these epochs (0-based; ones past the run are ignored)",
    )
    batches: int = Field(32, ge=1, description="b: teleport batches per scheduled epoch")
    steps: int = Field(8, ge=1, description="t: ascent steps per teleport batch")
    batch_size: int = Field(32, ge=1, description="n: samples per teleport batch")
    lr: float = Field(0.2, gt=0, description="eta_tele: teleport learning rate")
    rise: float | None = Field(
        None, gt=0, le=100,
        description="instead of a fixed lr: each step's eta is the one predicted to raise ||grad L||^2 by this share "
                    "of itself (0.1: 10 %), from the step's own direction, so one value fits models of any scale and "
                    "any point of training; cap and the back-offs apply as to lr; null: the fixed lr (the paper's)",
    )
    cap: float | None = Field(5.0, gt=0, description="CAP: stop ascent once ||grad L||^2 reaches this; null: no "
                                                    "absolute CAP, cap_ratio alone (it must be set)")
    cap_ratio: float | None = Field(
        None, gt=1, le=1e6,
        description="a CAP of each batch's own: stop its ascent once ||grad L||^2 reaches this multiple of its value "
                    "at the batch's start (2: doubled), or cap if that comes first; null: cap alone (the paper's)",
    )
    tau: float = Field(1.0, gt=0, le=1, description="eq. 3 threshold: kept share of ||R||_F^2")
    tau_rule: Literal["numerical_rank", "energy"] = Field(
        "numerical_rank",
        description="how eq. 3 reads tau: numerical_rank (exact, never below the numerical rank) or energy "
        "(cumulative energy in the model's precision: at tau=1 the negligible tail counts as captured, as in "
        "the paper's CNN results)",
    )
    loss_tol: float = Field(1e-3, ge=0, description="largest relative batch-loss change, rise or fall, of a step")
    max_backoff: int = Field(6, ge=0, description="halvings of eta before a step is given up")
    budget: float | None = Field(
        0.1, gt=0, le=1,
        description="largest share of the run's wall-clock time spent teleporting: a teleport that would pass it "
                    "is shortened (fewer batches or steps) or skipped, and the run's events say so; null: no budget",
    )
    ascent: Literal["auto", "host", "device", "cuda_graph"] = Field(
        "auto",
        description="how the ascent steps run: host (the guard decides in Python), device (it decides on the "
        "device: no host read between kernels), cuda_graph (those device steps captured once per model in a CUDA "
        "graph and replayed for every later batch of its shapes; without CUDA the device steps); auto: cuda_graph "
        "on one GPU, host on the CPU, across ranks and for a model a graph cannot hold or whose batch shapes keep "
        "changing (the fastest there: docs/results.md)",
    )
    hvp: Literal["exact", "difference"] = Field(
        "exact",
        description="how the teleport gradient H·grad L is computed (nullspace only): exact (the double backward "
        "of grad L, the paper's) or difference (a forward difference of two gradients, no double backward, half the "
        "kernels a step; float32/float64 weights; its direction within ~1e-4 of the exact one, the loss kept as "
        "exactly)",
    )
    reset_optimizer: bool = Field(False, description="clear optimizer state (momentum, Adam moments) after teleport")
    parallel: Literal["auto", "serial", "threads", "ray"] = "auto"

    @model_validator(mode="after")
    def _epochs_sorted(self) -> TeleportSpec:
        if len(set(self.epochs)) != len(self.epochs):
            raise ValueError("teleport.epochs has duplicates: list each epoch once")
        if self.cap is None and self.cap_ratio is None:
            raise ValueError("teleport.cap: null leaves the ascent unbounded; set teleport.cap_ratio (a CAP of each "
                             "batch's own, e.g. 2) or a number")
        object.__setattr__(self, "epochs", sorted(self.epochs))
        return self

    @property
    def step_field(self) -> str:
        """The field that sizes a step: ``teleport.rise`` when set, else ``teleport.lr``."""
        return "teleport.rise" if self.rise is not None else "teleport.lr"

    @property
    def step_value(self) -> float:
        return self.rise if self.rise is not None else self.lr

    @property
    def calmer(self) -> str:
        """What to do when a teleport made the loss diverge."""
        bound = (f"teleport.cap (now {self.cap:g})" if self.cap is not None else
                 f"teleport.cap_ratio (now {self.cap_ratio:g})")
        return f"lower {self.step_field} (now {self.step_value:g}) or {bound}"
