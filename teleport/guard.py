"""The host guard of one ascent step (Algorithm 1's CAP, and the back-offs): accept, shorten or give up.

Decided in Python on values read from the device (``teleport.nullspace._Run._steps``, ``teleport.symmetry``);
``teleport.on_device`` runs the same rules as device arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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
            eta *= _shorten(why, new.grad_norm_sq, grad_norm_sq, config.cap)
    restore()
    return None, eta, config.max_backoff + 1, why


def _shorten(why: str, after: float, before: float | None, cap: float) -> float:
    """η's factor for the next try: the secant to 0.95·CAP for a CAP overshoot (in [0.05, 0.5]), else ½."""
    if why != "cap" or before is None or not after > before:
        return 0.5
    return min(0.5, max(0.05, (0.95 * cap - before) / (after - before)))


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
