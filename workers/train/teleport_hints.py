"""What a run tells a person about its teleports: a setting that leaves them idle or too small to matter, an optimizer
whose later teleports seldom pay, a teleport that made no move (the runner then skips the rest), and the records a
teleport batch leaves (``workers.train.teleporting``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from api_schemas.spec import SCALE_FREE, TeleportSpec
from teleport import TeleportReport

IDLE = {  # a stop reason that leaves every batch of an epoch where it was -> what to change
    "cap": "every batch's ‖∇L‖² ({low:.3g} to {high:.3g}) was already at or over teleport.cap ({cap:g}): no step; "
           "raise teleport.cap above {high:.3g} to let teleport move",
    "no_free_directions": "no layer has a free direction (the teleport batch spans each layer's inputs): "
                          "lower teleport.batch_size (now {n})",
}


SMALL_RISE = 1.1  # a teleport batch whose every step was taken as asked yet raised ‖∇L‖² by less: η is too small
SUGGESTED_RISE, SUGGESTED_RATIO = SCALE_FREE["rise"], SCALE_FREE["cap_ratio"]  # what the hints suggest


def idle_hint(epoch: int, reports: list[TeleportReport], tp: TeleportSpec) -> dict[str, Any] | None:
    """A ``hint`` record when every teleport batch of the epoch took no step for one reason a setting decides (an
    LM's ‖∇L‖² is far over the default CAP of 5: its teleports cost time and move nothing), or took every step at
    ``teleport.lr`` without a back-off and still raised ‖∇L‖² by under 10 % (``small_steps_hint``), else None."""
    reasons = {r.stop_reason for r in reports}
    if reports and reasons == {"steps"}:
        return small_steps_hint(epoch, reports, tp)
    if not reports or any(r.steps for r in reports) or len(reasons) != 1 or next(iter(reasons)) not in IDLE:
        return None
    norms = [r.grad_norm_sq_before for r in reports]
    if reports[0].stop_reason == "cap" and (tp.cap is None or min(norms) < tp.cap):  # tries over CAP, not a CAP
        return None
    text = IDLE[reports[0].stop_reason].format(low=min(norms), high=max(norms), cap=tp.cap, n=tp.batch_size)
    if reports[0].stop_reason == "cap" and tp.cap_ratio is None:
        text += (f", or set teleport.cap: null with teleport.cap_ratio: {SUGGESTED_RATIO:g} (each batch stopped at "
                 f"{SUGGESTED_RATIO:g}x its own)")
    return {"kind": "hint", "epoch": epoch, "reason": reports[0].stop_reason,
            "message": f"teleport at epoch {epoch}: {text}"}


def small_steps_hint(epoch: int, reports: list[TeleportReport], tp: TeleportSpec) -> dict[str, Any] | None:
    """The ``small_steps`` hint: η (``teleport.lr``, or the one ``teleport.rise`` chose) moved every batch along
    without a back-off, by too little to matter (the paper's η from its MNIST table is ~10x too small for a char LM:
    ``docs/algorithm.md``)."""
    if any(r.backoffs or not r.steps or r.grad_norm_sq_before <= 0 for r in reports):
        return None
    best = max(reports, key=lambda r: r.grad_norm_sq_after / r.grad_norm_sq_before)
    rise = best.grad_norm_sq_after / best.grad_norm_sq_before
    if rise >= SMALL_RISE:
        return None
    return {"kind": "hint", "epoch": epoch, "reason": "small_steps",
            "message": f"teleport at epoch {epoch}: every step was taken without a back-off, yet ‖∇L‖² rose by at "
                       f"most {rise - 1:.1%} ({best.grad_norm_sq_before:.3g} to {best.grad_norm_sq_after:.3g} "
                       f"in {best.steps} steps): teleport moved too little to matter; {larger_steps(tp)}"}


def larger_steps(tp: TeleportSpec) -> str:
    """What to set when teleport's steps are too small to matter (the hint above, the preflight's advice)."""
    if tp.rise is not None:
        return f"raise teleport.rise (now {tp.rise:g})"
    return (f"set teleport.rise: {SUGGESTED_RISE:g} with teleport.cap_ratio: {SUGGESTED_RATIO:g} in place of "
            f"teleport.lr (now {tp.lr:g}): each batch's ‖∇L‖² raised to about {SUGGESTED_RATIO:g}x its own, in a step "
            "sized from its own slope whatever the model's scale (docs/algorithm.md)")


ADAPTIVE = ("adam", "adamw")  # optimizers whose step does not grow with the gradient's scale


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The spec's name of a torch optimizer where it has one (an own loop's: ``schedule_hint``), else its class's."""
    if isinstance(optimizer, torch.optim.AdamW):  # (before Adam: AdamW may derive from it)
        return "adamw"
    return "adam" if isinstance(optimizer, torch.optim.Adam) else type(optimizer).__name__.lower()


def schedule_hint(optimizer: str, tp: TeleportSpec, epochs: int) -> dict[str, Any] | None:
    """A ``hint`` record at the start of a run whose Adam(W) teleports after epoch 0 at the paper's fixed η (else
    None): measured, those cost time and seldom save any (``docs/algorithm.md``, "Teleport and Adam"). Not with
    ``teleport.rise``: there the measurements disagree (the char LM's later teleports paid, 0.76× against 0.84× with
    epoch 0 only; the digits MLP's did not, 1.27× against 1.07×), so no advice is better than a wrong one."""
    later = [e for e in tp.epochs if 0 < e < epochs]
    if not tp.enabled or tp.method != "nullspace" or optimizer not in ADAPTIVE or not later or tp.rise is not None:
        return None
    return {"kind": "hint", "epoch": 0, "reason": "adaptive_optimizer",
            "message": f"teleport with {optimizer} before epochs {[e for e in tp.epochs if e < epochs]}: Adam's step "
                       "lr·m/√v does not grow with ‖∇L‖, so the teleports after the first cost time and seldom save "
                       "any (measured: digits MLP 1.34× the baseline's seconds to its target, 0.92× with only epoch "
                       "0; docs/algorithm.md); consider teleport.epochs: [0]"}


def teleport_record(epoch: int, batch: int, report: TeleportReport, calibration: bool) -> dict[str, Any]:
    """A teleport batch's record; ``calibration``: the budget's first, one-step batch (``workers.train.budget``)."""
    return {"kind": "teleport", "epoch": epoch, "batch": batch, **report.to_dict(),
            **({"calibration": True} if calibration else {})}


@dataclass
class IdleHints:
    """Says ``idle_hint`` once a run: the first epoch whose teleport moved nothing for a setting's sake."""

    said: bool = False

    def after(self, epoch: int, reports: list[TeleportReport], tp: TeleportSpec) -> dict[str, Any] | None:
        hint = None if self.said else idle_hint(epoch, reports, tp)
        self.said = self.said or hint is not None
        return hint


REFUSED = {"cap": "every try overshot CAP", "loss_tol": "every try moved the batch loss past teleport.loss_tol",
           "no_ascent": "every try lowered ‖∇L‖²", "not_finite": "every try gave a loss that is not finite"}


def _skipped(epoch: int, reason: str, why: str) -> dict[str, Any]:
    return {"kind": "budget", "epoch": epoch, "reason": "no_move", "stop_reason": reason,
            "message": f"teleport made no move at epoch {epoch} ({why}): the next teleports skipped"}


def stuck_record(epoch: int, report: TeleportReport, tp: TeleportSpec) -> dict[str, Any] | None:
    """The ``budget`` record of a teleport batch that could not take a step whatever its step size, else None:
    already at CAP — the runner skips the epoch's other batches (the model is at CAP: their ‖∇L‖² is alike) and then
    teleport epochs in doubling runs; the next epoch it tries stops at its first batch if still at CAP (one plain
    forward + backward: the ``Teleporter`` checks first after a batch at CAP), and a model that trained back under
    CAP teleports again; or no free direction
    — the runner skips the run's remaining teleports (the batch size decides it, and it does not change)."""
    if report.steps or report.backoffs:
        return None
    if report.stop_reason == "cap":
        return {**_skipped(epoch, "cap", f"‖∇L‖² {report.grad_norm_sq_before:.3g} ≥ cap {report_cap(tp):g}"),
                "message": f"teleport made no move at epoch {epoch} (‖∇L‖² {report.grad_norm_sq_before:.3g} ≥ cap "
                           f"{report_cap(tp):g}): its next batches skipped, and teleport epochs skipped in "
                           "doubling runs while the model stays at CAP"}
    if report.stop_reason == "no_free_directions":
        return _skipped(epoch, "no_free_directions",
                        f"no layer has a free direction at teleport.batch_size {tp.batch_size}")
    return None


def refused_record(epoch: int, reports: list[TeleportReport]) -> dict[str, Any] | None:
    """The ``budget`` record of an epoch's teleport whose every batch refused every try (none moved): the runner skips
    the run's remaining teleports; None when a batch moved."""
    if not reports or any(r.steps or not r.backoffs for r in reports):  # one moved, or one stopped before a try
        return None
    reason = reports[0].stop_reason
    return _skipped(epoch, reason, REFUSED.get(reason, f"every batch stopped: {reason}"))


def report_cap(tp: TeleportSpec) -> float:
    """The CAP a batch was held to: the spec's (∞ when none: a cap_ratio alone)."""
    return float("inf") if tp.cap is None else tp.cap
