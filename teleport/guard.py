"""The host guard of one ascent step (Algorithm 1's CAP, and the back-offs): accept, shorten or give up.

Decided in Python on values read from the device (``teleport.ascent.Run._steps``, ``teleport.symmetry``);
``teleport.on_device`` runs the same rules as device arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from teleport.objective import Objective
from teleport.report import TeleportConfig


def guarded_step(
    move: Callable[[float], None],
    restore: Callable[[], None],
    evaluate: Callable[[], Objective],
    loss0: float,
    eta: float,
    config: TeleportConfig,
    grad_norm_sq: float | None = None,
    final_evaluate: Callable[[], Objective] | None = None,
    aimed: bool = False,
    first: Objective | None = None,
    slope: float | None = None,
) -> tuple[Objective | None, float, int, str]:
    """Take a step of size η, shortening it until the step is acceptable.

    Acceptable: L and ‖∇L‖² finite, ‖∇L‖² ≤ CAP, |L − L₀| ≤ loss_tol·|L₀| (a rise or a fall), and —
    given the ‖∇L‖² before the step — an ascent. A step over CAP is shortened by the secant to CAP
    (from the ‖∇L‖² before and after it, given ``grad_norm_sq``), anything else by halving.
    Returns the objective after the accepted step (None when every try failed and ``restore`` put
    the weights back), the η that worked (kept for the next step), the back-offs and why it ended:
    "steps" (accepted), "cap" (accepted once shortened to fit under CAP — or ``aimed`` there from the
    start: CAP is reached), or on failure "not_finite", "cap", "loss_tol" or "no_ascent".
    A try whose acceptance would end the teleport ("cap") is evaluated by ``final_evaluate`` when
    given (no graph for an H·∇L that will never be asked for). ``first``: the first try, already moved
    to and evaluated by the caller (η decided on the device, see ``aim_on_device``).
    """
    why = "cap" if aimed else "steps"
    for attempt in range(config.max_backoff + 1):
        if attempt == 0 and first is not None:
            new = first
        else:
            move(eta)
            new = (final_evaluate or evaluate)() if why == "cap" else evaluate()
        verdict = step_verdict(new, loss0, config, grad_norm_sq)
        if verdict == "steps":
            return new, eta, attempt, "cap" if why == "cap" else "steps"
        why = verdict
        if attempt < config.max_backoff:
            eta *= _shorten(why, new.grad_norm_sq, grad_norm_sq, config.cap, None if slope is None else slope * eta)
    restore()
    return None, eta, config.max_backoff + 1, why


def _shorten(why: str, after: float, before: float | None, cap: float, predicted: float | None) -> float:
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
    (``teleport.on_device``) share it."""
    rise, gap = after - before, 0.95 * cap - before
    chord = gap / torch.where(rise > 0, rise, 1.0)
    bend = rise - predicted  # c·η_try²: what the first order missed
    curved = (bend > 0) & (predicted >= 0) & (gap > 0) & torch.isfinite(predicted)
    root_of = (predicted.square() + 4.0 * bend * gap).clamp_min(0.0).sqrt() + predicted  # > 0 where curved
    root = 2.0 * gap / torch.where(curved, root_of, 1.0)  # the stable form of (−s·η + √((s·η)² + 4c·η²·gap)) / 2c·η²
    return torch.where(curved, root, chord).clamp(0.05, 0.95)


def step_verdict(new: Objective, loss0: float, config: TeleportConfig, grad_norm_sq: float | None) -> str:
    """"steps" for an acceptable step, else the first rule it breaks."""
    if not (math.isfinite(new.loss) and math.isfinite(new.grad_norm_sq)):
        return "not_finite"
    if new.grad_norm_sq > config.cap:
        return "cap"
    if abs(new.loss - loss0) > config.loss_tol * max(abs(loss0), 1e-12):
        return "loss_tol"
    if grad_norm_sq is not None and new.grad_norm_sq < grad_norm_sq:
        return "no_ascent"
    return "steps"
