"""The hyperparameters of a teleport (``TeleportConfig``), checked when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

TAU_RULES = ("numerical_rank", "energy")
ASCENTS = ("auto", "host", "device", "cuda_graph")
HVPS = ("exact", "difference")


@dataclass(frozen=True)
class TeleportConfig:
    """Hyperparameters of one teleport batch (paper symbols).

    steps: t ascent steps; lr: η_tele; cap: CAP on ‖∇L‖²; tau: eq. 3 threshold; rise: when set, each step's η is the
    one predicted (to first order, from the step's own direction) to raise ‖∇L‖² by this share of itself — η =
    rise·‖∇L‖² / (2‖π(H·∇L)‖²) — in place of a fixed ``lr``: a step scale that does not depend on the model's units
    (``docs/algorithm.md``); CAP and the back-offs apply to it as to ``lr``; cap_ratio: each batch's CAP is min(cap,
    cap_ratio·‖∇L‖² at its start) (cap may be ∞ then; with ascent "cuda_graph" one captured tick serves batches of any
    CAP: a state of the tick, not a constant); loss_tol: largest relative change of the batch loss, either way, a step
    may cause before it is backed off; max_backoff: halvings of η tried before the teleport stops; tau_rule: how eq. 3
    reads τ ("numerical_rank": exact, never fewer directions than the numerical rank; "energy": the cumulative energy
    in the model's precision, which at τ = 1 frees the negligible tail); ascent: how the steps run ("host": the guard
    decides in Python, one host read a try; "device": the guard decides on the device, ``teleport.ascent.device``;
    "cuda_graph": those ticks captured once a model and replayed for every later batch whose shapes match,
    ``teleport.ascent.graphs``; "auto": the CUDA graph on one GPU, the host guard on the CPU, across ranks and for a
    model no graph holds or whose shapes keep changing, ``teleport.ascent.choose``); hvp: how H·∇L is computed
    ("exact": the double backward of ∇L's graph, the paper's gradient; "difference": a forward difference of two
    gradients, no double backward, ``teleport.hvp.difference``; with every ascent: in a device tick the shifted
    gradient reads nothing on the host, so a CUDA graph can hold it with no double backward in it); check_first: L and
    ‖∇L‖² from a plain forward + backward decide a batch at CAP or not finite before the recorded one (every use of
    every parameter, ∇L's graph kept): such a batch then costs that pass alone, one that steps one pass more; None
    (the default): when the model's last teleport batch was at CAP before its bases (``docs/algorithm.md``).
    """

    steps: int = 8
    lr: float = 0.2
    cap: float = 5.0
    tau: float = 1.0
    loss_tol: float = 1e-3
    max_backoff: int = 6
    tau_rule: str = "numerical_rank"
    ascent: str = "auto"
    hvp: str = "exact"
    check_first: bool | None = None
    rise: float | None = None
    cap_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"teleport.steps must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"teleport.lr must be > 0, got {self.lr}")
        if self.rise is not None and not self.rise > 0:
            raise ValueError(f"teleport.rise must be > 0 (or None: a fixed teleport.lr), got {self.rise}")
        if self.cap_ratio is not None and not self.cap_ratio > 1:
            raise ValueError(f"teleport.cap_ratio must be > 1 (or None: CAP alone), got {self.cap_ratio}")
        if not self.cap > 0:
            raise ValueError(f"teleport.cap must be > 0, got {self.cap}")
        if not 0 < self.tau <= 1:
            raise ValueError(f"teleport.tau must be in (0, 1], got {self.tau}")
        if self.tau_rule not in TAU_RULES:
            raise ValueError(f"teleport.tau_rule must be one of {', '.join(TAU_RULES)}, got {self.tau_rule!r}")
        if self.ascent not in ASCENTS:
            raise ValueError(f"teleport.ascent must be one of {', '.join(ASCENTS)}, got {self.ascent!r}")
        if self.hvp not in HVPS:
            raise ValueError(f"teleport.hvp must be one of {', '.join(HVPS)}, got {self.hvp!r}")
        if self.loss_tol < 0 or self.max_backoff < 0:
            raise ValueError("teleport.loss_tol and teleport.max_backoff must be >= 0")


    def for_batch(self, grad_norm_sq: float) -> TeleportConfig:
        """This config with the CAP of a batch whose ‖∇L‖² starts at ``grad_norm_sq`` (``cap_ratio``)."""
        if self.cap_ratio is None or not 0 < grad_norm_sq < math.inf:
            return self
        return replace(self, cap=min(self.cap, self.cap_ratio * grad_norm_sq))
