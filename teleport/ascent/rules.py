"""The step rules of Algorithm 1's ascent, written once: when a try is accepted, how a refused one is shortened, how
far a step is aimed, and why a batch takes no step at all. The host guard (``teleport.ascent.host``) applies them to
values read on the host, the device ticks (``teleport.ascent.device``) as arithmetic on 0-d device tensors, and the
reference (``teleport.reference``) as plainly as it can.

Accepted: L and ‖∇L‖² finite, ‖∇L‖² ≤ CAP, |L − L₀| ≤ loss_tol·|L₀| (a rise or a fall), and — given the ‖∇L‖² before
the step — an ascent (``step_verdict``). A try over CAP is shortened by the curve through it (``shorten_factor``),
anything else by halving; ``max_backoff`` halvings at most.

Aiming. The η of a step aimed at CAP, and what a model's earlier aimed steps taught it (``AimScale``).

d‖∇L‖²/dη at η = 0 along U = π(G), G = H·∇L, is 2⟨G, π(G)⟩ = 2‖π(G)‖² (π is an orthogonal projector), so
‖∇L‖²(η) ≈ ‖∇L‖² + 2η‖U‖². A step whose first-order rise would pass CAP is aimed at ``AIM`` of the way there: η₁ =
AIM·(CAP − ‖∇L‖²) / 2‖U‖². ‖∇L‖² is convex along the step, so η₁ overshoots by what the first order misses: 4-25 % of
the rise on the digits MLP (AIM's margin covers it), but on a GPT-style LM in training far more — after 150 AdamW
steps (``benchmarks.lm_trained``) the try at η₁ raised ‖∇L‖² 13-65x where CAP allowed 2x, so every batch took a second
try (shortened by the curve through the first, ``shorten_factor``): one more forward and backward, 15 % of
that LM's teleport.

A model's batches bend alike, so each aimed step's outcome teaches the next: ``AimScale.now`` (m, one 0-d float64 a
model, kept by its ``Teleporter`` like the difference's ``ShiftScale``) scales η₁, and an aimed step accepted at η
(after any shortening) with a rise r sets

    m ← clamp(η/η₁ · (AIM·gap / r)^¼, M_MIN, 1)

— the η that landed, nudged toward the aim's target by the fourth root of how far it fell short (a rise that grows
like η⁴ near the target, as that LM's does, lands on it; a gentler curve is reached over a few batches, a steeper one
overshoots and is shortened as before). m starts at 1 (η₁, as before any was learned), never exceeds it (η₁ already
overshoots a convex curve), and a step not aimed leaves it alone. Device arithmetic, no host read: the host guard
(``teleport.ascent.host``) and the device ticks (``teleport.ascent.device``) learn alike, and a CUDA graph that
captured m reads and writes the same tensor at every replay.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from teleport.config import TeleportConfig
from teleport.hvp.objective import squared_norm

AIM = 0.8  # share of the way to CAP a step predicted to overshoot it is aimed at
M_MIN = 1e-4  # the least factor on η₁ learned (a rise 1e16 times the first order's)
POWER = 0.25  # how much of the shortfall to the aim's target m makes up: the root of a rise like η⁴


class AimScale:
    """A model's factor m on the first-order aim η₁ (``now``, a 0-d float64 on its weights' device; see the module),
    updated in place."""

    def __init__(self, device: torch.device) -> None:
        self.now = torch.ones((), dtype=torch.float64, device=device)

    def state_dict(self) -> dict[str, float]:
        return {"now": float(self.now)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        with torch.no_grad():
            self.now.fill_(state["now"])

    def learn(self, used: Tensor | None, eta_first: Tensor, eta_used: Tensor | float, rise: Tensor | float,
              gap: Tensor | float) -> None:
        """After an aimed step, accepted (where ``used``, a 0-d bool; None: accepted) at ``eta_used`` whose first try
        was ``eta_first`` = m·η₁, with ``rise`` of ‖∇L‖² over a ``gap`` to CAP at its start: m as the module says."""
        tiny = torch.finfo(torch.float64).tiny
        with torch.no_grad():
            rise, gap = (torch.as_tensor(t, dtype=torch.float64, device=self.now.device) for t in (rise, gap))
            shortfall = (AIM * gap / rise.clamp_min(tiny)).pow(POWER)
            new = self.now * eta_used / eta_first.clamp_min(tiny) * shortfall
            ok = (rise > 0) & (gap > 0) & torch.isfinite(new)
            if used is not None:
                ok = ok & used
            self.now.copy_(torch.where(ok, new.clamp(M_MIN, 1.0), self.now))


def aims_first(rise: float | None, cap_ratio: float | None) -> bool:
    """Whether a batch's step 1 is aimed at CAP whatever the batch, known before any tick: its rise-aim passes the
    batch's own CAP, rise·‖∇L‖²₀ > (cap_ratio − 1)·‖∇L‖²₀ ≥ CAP − ‖∇L‖²₀ (``api_schemas.spec.SCALE_FREE``: 1.5 > 1).
    Where ``aim_on_device`` does not aim it after all (U = 0, ‖∇L‖²₀ = 0: η·U = 0), the try moved nothing, so the U
    at the weights it leaves is the one the step started from (``device.DeviceAscent._judge`` relies on it)."""
    return rise is not None and cap_ratio is not None and rise > (cap_ratio - 1.0) * (1.0 + 1e-9)


def aim_on_device(eta: float | Tensor, grad_norm_sq: float | Tensor, direction: list[Tensor],
                  cap: float | Tensor, rise: float | None = None,
                  scale: AimScale | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """η, or — when the first-order prediction overshoots CAP — m·η₁, η₁ the η predicted to cover ``AIM`` of the way
    there (m: ``scale``'s, else 1; see the module).

    ``rise`` (``TeleportConfig.rise``): η is the one predicted to raise ‖∇L‖² by ``rise``·‖∇L‖² (``eta`` where the
    slope is 0: U = 0 moves nothing). Decided on the device: (η, aimed, slope) are 0-d tensors, read back with the
    next evaluation's L and ‖∇L‖² (``objective``'s ``fetch``), so the step has one host sync; the slope 2‖U‖² lets a
    try that overshoots CAP be shortened by the curve through it (``shorten_factor``).
    """
    slope = 2.0 * squared_norm(direction)  # float64, on the weights' device
    sloped = torch.isfinite(slope) & (slope > 0)
    safe_slope = torch.where(sloped, slope, torch.ones_like(slope))
    eta = eta if isinstance(eta, Tensor) else torch.full_like(slope, eta)
    if rise is not None:
        eta = torch.where(sloped, rise * grad_norm_sq / safe_slope, eta)
    gap = cap - grad_norm_sq
    shorten = sloped & (eta * slope > gap)
    aimed = AIM * gap / safe_slope
    if scale is not None:
        aimed = aimed * scale.now
    return torch.where(shorten, aimed, eta), shorten, slope


def shorten(why: str, after: float, before: float | None, cap: float, predicted: float | None) -> float:
    """η's factor for the next try: ``shorten_factor`` for a CAP overshoot, else ½."""
    if why != "cap" or before is None or not after > before:
        return 0.5
    f64 = torch.float64
    return float(shorten_factor(torch.tensor(after, dtype=f64), torch.tensor(before, dtype=f64), cap,
                                torch.tensor(math.nan if predicted is None else predicted, dtype=f64)))


def shorten_factor(after: Tensor, before: Tensor, cap: float | Tensor, predicted: Tensor) -> Tensor:
    """η's factor that lands a try which overshot CAP (‖∇L‖² from ``before`` to ``after`` > CAP) at 0.95·CAP.

    Along one step's direction ‖∇L‖²(η) = before + s·η + c·η² + …, s = 2‖π(H·∇L)‖² (``aim_on_device``);
    ``predicted`` = s·η_try is the first-order rise of the try, so ``after`` − before − predicted is its quadratic
    term, c·η_try². When that is positive (‖∇L‖² convex along the step: every model measured) the factor is the
    root of the quadratic through the three — a try aimed by the first order overshoots most where the curve bends
    most, and the chord from ``before`` to ``after`` then lands far short (a GPT-style LM: ×1.34 of a ×2 CAP) —
    in [0.05, 0.95]. Otherwise (no slope known: ``predicted`` NaN; no bend) the chord's, the secant to 0.95·CAP, in
    [0.05, 0.95] too. 0-d float64 tensors on any device, no host read: the host guard and the device ticks
    (``teleport.ascent.device``) share it."""
    rise, gap = after - before, 0.95 * cap - before
    chord = gap / torch.where(rise > 0, rise, 1.0)
    bend = rise - predicted  # c·η_try²: what the first order missed
    curved = (bend > 0) & (predicted >= 0) & (gap > 0) & torch.isfinite(predicted)
    root_of = (predicted.square() + 4.0 * bend * gap).clamp_min(0.0).sqrt() + predicted  # > 0 where curved
    root = 2.0 * gap / torch.where(curved, root_of, 1.0)  # the stable form of (−s·η + √((s·η)² + 4c·η²·gap)) / 2c·η²
    return torch.where(curved, root, chord).clamp(0.05, 0.95)


def step_verdict(loss: float, grad_norm_sq: float, loss0: float, config: TeleportConfig,
                 before: float | None) -> str:
    """"steps" for an acceptable try (L and ‖∇L‖² after it; ``before``: ‖∇L‖² before it, None: no ascent asked),
    else the first rule it breaks."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm_sq)):
        return "not_finite"
    if grad_norm_sq > config.cap:
        return "cap"
    if abs(loss - loss0) > config.loss_tol * max(abs(loss0), 1e-12):
        return "loss_tol"
    if before is not None and grad_norm_sq < before:
        return "no_ascent"
    return "steps"


def early_reason(loss: float, grad_norm_sq: float, cap: float) -> str | None:
    """Why a batch of this L and ‖∇L‖² takes no step whatever its bases: "not_finite", "cap", else None."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm_sq)):
        return "not_finite"
    return "cap" if grad_norm_sq >= cap else None
