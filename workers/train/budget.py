"""Teleport's wall-clock budget: a run never spends more than ``teleport.budget`` of its time teleporting.

Teleport is paid in time that could have trained. With a budget B (a share of the run's wall clock), the
teleport seconds T of the whole run may reach at most

    T ≤ B / (1 − B) · P          P = the run's projected seconds outside teleport (training, evaluation)

so that T / (T + P) ≤ B. P is the mean epoch so far times the run's epochs; before the first epoch it is
estimated from one timed forward + backward on a training batch (``probe``). Before each teleport batch
the runner asks ``steps_for_batch``: the batch's predicted cost is the seconds per unit of work seen so far
times (1 + steps) (one unit: the capture, the first objective and the bases; one more per ascent step);
the batch is shortened to the steps that fit, or skipped when not one does. Across data-parallel ranks
the inputs are averaged first, so every rank takes the same decision (a teleport is collective).

The run's first teleport batch *calibrates*: it takes at most ``CALIBRATION_STEPS`` step, whatever the probe
predicts. The probe's unit (a multiple of a forward + backward) is a guess that a GPU breaks: there an ascent
step is launch-bound, ~5 forward + backward passes and not 3, and the first teleport loads kernels training
never used (the H200's char LM spent 24 % of a 10 % budget on its first batch of 8 steps). One step
measures the unit at the cost of one step, and every later batch is sized from what was measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from teleport import TeleportReport
from workers.train.context import RunContext

FIRST_UNIT_PER_STEP = 3.0  # before any teleport ran: one unit ≈ 3 forward+backward passes on the teleport batch
CALIBRATION_STEPS = 1  # the ascent steps of the run's first teleport batch, which measures a unit's seconds


@dataclass
class TeleportBudget:
    """What the run has spent and what it may still spend on teleport (``share`` None: no budget)."""

    share: float | None
    epochs: int
    probe_epoch_s: float | None = None  # an epoch's estimated seconds before any epoch ran
    probe_unit_s: float | None = None  # a teleport unit's estimated seconds before any teleport ran
    work_units: float = 0.0  # Σ (1 + steps) over the teleport batches run
    work_seconds: float = 0.0  # their seconds

    def allowance(self, train_seconds: float, epochs_done: int) -> float:
        """B / (1 − B) · P: the teleport seconds the whole run may spend (inf without a budget, or while nothing
        tells the run's length: an own loop before its first reported epoch)."""
        if self.share is None or (epochs_done == 0 and self.probe_epoch_s is None):
            return math.inf
        if epochs_done > 0:
            per_epoch = train_seconds / epochs_done
        else:
            per_epoch = self.probe_epoch_s or 0.0
        return self.share / (1.0 - self.share) * per_epoch * self.epochs if self.share < 1 else math.inf

    def unit_seconds(self) -> float:
        if self.work_units > 0:
            return self.work_seconds / self.work_units
        return self.probe_unit_s or 0.0

    @property
    def calibrating(self) -> bool:
        """No teleport batch has been measured yet: the next one the budget sizes takes at most
        ``CALIBRATION_STEPS``."""
        return self.share is not None and self.share < 1 and self.work_units == 0

    def calibrates(self, steps: int, asked: int) -> bool:
        """Whether a batch of ``steps`` (``asked``: the config's) is the run's calibration batch: a record says so,
        and it is not a cut."""
        return self.calibrating and steps < asked

    def steps_for_batch(self, steps: int, spent: float, train_seconds: float, epochs_done: int,
                        agree: Callable[[list[float]], list[float]] | None = None) -> int:
        """The ascent steps the next teleport batch may take (0: skip it), given ``spent`` teleport seconds.

        ``agree``: averages [left, unit] across ranks (every rank then decides alike; ``calibrating`` is the
        same on every rank: each records the same reports)."""
        if self.share is None:
            return steps
        wanted = min(steps, CALIBRATION_STEPS) if self.calibrating else steps
        left, unit = self.allowance(train_seconds, epochs_done) - spent, self.unit_seconds()
        if agree is not None:
            left, unit = agree([left, unit])
        if not math.isfinite(left):  # nothing tells the run's length yet (an own loop before its first epoch)
            return steps
        return wanted if unit <= 0 else max(0, min(wanted, math.floor(left / unit) - 1))

    def record(self, report: TeleportReport) -> None:
        """Learn the seconds per unit of work from a teleport batch that ran."""
        self.work_units += 1 + report.steps
        self.work_seconds += report.seconds


def agree_across(ctx: RunContext) -> Callable[[list[float]], list[float]] | None:
    """The ranks' mean of a list of numbers (every rank then takes the same decision); None in one process."""
    if ctx.world_size == 1:
        return None
    return lambda values: [v / ctx.world_size for v in ctx.all_reduce_sum(values)]


def cut_event(epoch: int, share: float, planned: tuple[int, int], done: tuple[int, int]) -> dict[str, object]:
    """The ``budget`` record of an epoch whose teleport the budget cut: planned and done (batches, steps)."""
    return {"kind": "budget", "epoch": epoch, "budget": share, "batches": done[0], "planned_batches": planned[0],
            "steps": done[1], "planned_steps": planned[1], "message": cut_message(epoch, planned, done, share)}


def probe_seconds(step: Callable[[], object], repeats: int = 2) -> float:
    """The fastest of ``repeats`` timed calls of ``step`` (one forward + backward): the first may pay warm-up."""
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best


def cut_message(epoch: int, planned: tuple[int, int], done: tuple[int, int], share: float) -> str:
    """``teleport at epoch 3 shortened to 2 batches: budget 10 %`` (or skipped, or fewer steps);
    ``planned``: (batches, steps), ``done``: (batches run, fewest steps of one)."""
    (batches, steps), (ran, least_steps) = planned, done
    budget = f"budget {share * 100:g} %"
    if ran == 0:
        return f"teleport at epoch {epoch} skipped: {budget}"
    what = f"{ran} batches" if ran < batches else f"batches of as few as {least_steps} steps"
    if ran < batches and least_steps < steps:
        what += f", the shortest {least_steps} of its {steps} steps"
    return f"teleport at epoch {epoch} shortened to {what}: {budget}"
