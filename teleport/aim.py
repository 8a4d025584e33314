"""The η of a step aimed at CAP, and what a model's earlier aimed steps taught it (``AimScale``).

d‖∇L‖²/dη at η = 0 along U = π(G), G = H·∇L, is 2⟨G, π(G)⟩ = 2‖π(G)‖² (π is an orthogonal projector), so
‖∇L‖²(η) ≈ ‖∇L‖² + 2η‖U‖². A step whose first-order rise would pass CAP is aimed at ``AIM`` of the way there: η₁ =
AIM·(CAP − ‖∇L‖²) / 2‖U‖². ‖∇L‖² is convex along the step, so η₁ overshoots by what the first order misses: 4-25 % of
the rise on the digits MLP (AIM's margin covers it), but on a GPT-style LM in training far more — after 150 AdamW
steps (``benchmarks.lm_trained``) the try at η₁ raised ‖∇L‖² 13-65x where CAP allowed 2x, so every batch took a second
try (shortened by the curve through the first, ``guard.shorten_factor``): one more forward and backward, 15 % of
that LM's teleport.

A model's batches bend alike, so each aimed step's outcome teaches the next: ``AimScale.now`` (m, one 0-d float64 a
model, kept with it like ``difference.ShiftScale``) scales η₁, and an aimed step accepted at η (after any
shortening) with a rise r sets

    m ← clamp(η/η₁ · (AIM·gap / r)^¼, M_MIN, 1)

— the η that landed, nudged toward the aim's target by the fourth root of how far it fell short (a rise that grows
like η⁴ near the target, as that LM's does, lands on it; a gentler curve is reached over a few batches, a steeper
one overshoots and is shortened as before). m starts at 1 (η₁, as before any was learned), never exceeds it (η₁
already overshoots a convex curve), and a step not aimed leaves it alone. Device arithmetic, no host read: the host
guard (``ascent.Run``) and the device ticks (``teleport.on_device``) learn alike, and a CUDA graph that captured m
reads and writes the same tensor at every replay.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from teleport.objective import squared_norm

AIM = 0.8  # share of the way to CAP a step predicted to overshoot it is aimed at
M_MIN = 1e-4  # the least factor on η₁ learned (a rise 1e16 times the first order's)
POWER = 0.25  # how much of the shortfall to the aim's target m makes up: the root of a rise like η⁴


class AimScale:
    """A model's factor m on the first-order aim η₁ (``now``, a 0-d float64 on its weights' device; see the module),
    updated in place."""

    def __init__(self, device: torch.device) -> None:
        self.now = torch.ones((), dtype=torch.float64, device=device)

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


_SCALES: weakref.WeakKeyDictionary[object, AimScale] = weakref.WeakKeyDictionary()


def aim_scale(model: object, like: Tensor) -> AimScale:
    """The model's ``AimScale`` on ``like``'s device, kept with the model (its next teleport starts from it)."""
    scale = _SCALES.get(model)
    if scale is None or scale.now.device != like.device:
        scale = _SCALES[model] = AimScale(like.device)
    return scale


def forget(model: object) -> None:
    """Drop what the model's aimed steps taught it: its next aim is the first order's again (benchmarks that set the
    two side by side)."""
    _SCALES.pop(model, None)


def aims_first(rise: float | None, cap_ratio: float | None) -> bool:
    """Whether a batch's step 1 is aimed at CAP whatever the batch, known before any tick: its rise-aim passes the
    batch's own CAP, rise·‖∇L‖²₀ > (cap_ratio − 1)·‖∇L‖²₀ ≥ CAP − ‖∇L‖²₀ (``api_schemas.spec.SCALE_FREE``: 1.5 > 1).
    Where ``aim_on_device`` does not aim it after all (U = 0, ‖∇L‖²₀ = 0: η·U = 0), the try moved nothing, so the U
    at the weights it leaves is the one the step started from (``on_device.DeviceAscent._judge`` relies on it)."""
    return rise is not None and cap_ratio is not None and rise > (cap_ratio - 1.0) * (1.0 + 1e-9)


def aim_on_device(eta: float | Tensor, grad_norm_sq: float | Tensor, direction: list[Tensor],
                  cap: float | Tensor, rise: float | None = None,
                  scale: AimScale | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """η, or — when the first-order prediction overshoots CAP — m·η₁, η₁ the η predicted to cover ``AIM`` of the way
    there (m: ``scale``'s, else 1; see the module).

    ``rise`` (``TeleportConfig.rise``): η is the one predicted to raise ‖∇L‖² by ``rise``·‖∇L‖² (``eta`` where the
    slope is 0: U = 0 moves nothing). Decided on the device: (η, aimed, slope) are 0-d tensors, read back with the
    next evaluation's L and ‖∇L‖² (``objective``'s ``fetch``), so the step has one host sync; the slope 2‖U‖² lets a
    try that overshoots CAP be shortened by the curve through it (``guard.shorten_factor``).
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
