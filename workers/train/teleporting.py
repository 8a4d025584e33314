"""One scheduled epoch's teleport (paper, Algorithm 1): b random batches of n training samples, t ascent
steps each, within the run's wall-clock budget (``workers.train.budget``). The loop in ``workers.train.loop`` calls
``Teleporter.before_epoch`` before each scheduled epoch; every record goes to the run's sink:

- ``{"kind": "teleport", "epoch", "batch", **TeleportReport.to_dict()}`` per teleport batch;
- ``{"kind": "budget", "epoch", "message", ...}`` when the budget shortened or skipped the epoch's teleport.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate

from api_schemas.spec import SCALE_FREE, TeleportSpec
from teleport import BasisExecutor, TeleportConfig, TeleportReport, symmetry_teleport_batch, teleport_batch
from workers.train.budget import FIRST_UNIT_PER_STEP, TeleportBudget, agree_across, cut_event, probe_seconds
from workers.train.context import RunContext


def to_device(batch: Any, device: torch.device, dtype: torch.dtype, *,
              non_blocking: bool = False) -> tuple[Tensor, Tensor]:
    """(x, y) on ``device``; floating inputs/targets in the run's dtype (cast there), token ids and labels untouched.
    ``non_blocking``: a batch in pinned memory is copied without the host waiting for it (a CUDA training step: the
    copy is ordered on the current stream, where the step uses it; never for a batch another stream reads)."""
    x, y = batch
    x, y = x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)
    return (x.to(dtype) if x.is_floating_point() else x), (y.to(dtype) if y.is_floating_point() else y)


def sample_batch(dataset: Dataset, indices: Tensor) -> tuple[Tensor, Tensor]:
    """The samples at ``indices``, stacked like a DataLoader batch."""
    x, y = default_collate([dataset[int(i)] for i in indices])
    return x, y


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


class TeleportDiverged(RuntimeError):
    """A teleport batch ended with a non-finite loss (the loop turns it into TrainingDiverged)."""

    def __init__(self, batch: int, loss: float) -> None:
        super().__init__(f"teleport batch {batch}")
        self.batch, self.loss = batch, loss


@dataclass
class Teleporter:
    """Everything a scheduled epoch's teleport needs, fixed for the run; ``budget`` learns as it goes."""

    tp: TeleportSpec
    config: TeleportConfig
    model: nn.Module  # the bare module (never a DDP wrapper): teleport moves it
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    train: Dataset
    ctx: RunContext
    dtype: torch.dtype
    seed: int
    holdout: tuple[Tensor, Tensor]
    executor: BasisExecutor | None
    budget: TeleportBudget
    cuts: int = 0
    hints: IdleHints = dataclasses.field(default_factory=IdleHints)

    @property
    def sharded(self) -> bool:
        return self.ctx.comm is not None and self.tp.method == "nullspace"

    def probe(self, net: nn.Module, batch_size: int, batches_per_epoch: int) -> None:
        """Before any epoch ran: time one forward + backward on a training batch (eval mode: no running
        statistic moves), to project the run's length and a teleport unit's cost."""
        if self.budget.share is None or self.budget.probe_epoch_s is not None:
            return
        idx = torch.arange(min(batch_size, len(self.train)))  # type: ignore[arg-type]
        x, y = to_device(sample_batch(self.train, idx), self.ctx.device, self.dtype)
        was = net.training
        net.eval()

        def step() -> None:
            self.loss_fn(net(x), y).backward()
            for p in net.parameters():
                p.grad = None
            if x.device.type == "cuda":  # the GPU's time, not the launches'
                torch.cuda.synchronize(x.device)

        try:
            seconds = probe_seconds(step)
        finally:
            net.train(was)
        self.budget.probe_epoch_s = seconds * batches_per_epoch
        self.budget.probe_unit_s = FIRST_UNIT_PER_STEP * seconds * self.tp.batch_size / max(len(idx), 1)

    def before_epoch(self, epoch: int, spent: float, train_seconds: float, epochs_done: int) -> int:
        """Teleport on up to ``tp.batches`` batches; returns how many ran. ``spent``: teleport seconds of
        the run so far; ``train_seconds``: its seconds outside teleport over ``epochs_done`` epochs."""
        start = time.perf_counter()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)  # same draw on every rank
        ran, least, reports = 0, self.tp.steps, []
        for i in range(self.tp.batches):
            now = spent + time.perf_counter() - start
            steps = self.budget.steps_for_batch(self.tp.steps, now, train_seconds, epochs_done, agree_across(self.ctx))
            if steps == 0:
                break
            calibrating = self.budget.calibrates(steps, self.tp.steps)
            idx = torch.randperm(len(self.train), generator=g)[: self.tp.batch_size]  # type: ignore[arg-type]
            report = self._batch(idx, steps)
            self.ctx.sink.emit(teleport_record(epoch, i, report, calibrating))
            if not math.isfinite(report.loss_after):
                raise TeleportDiverged(i, report.loss_after)
            self.budget.record(report)
            reports.append(report)
            ran, least = ran + 1, least if calibrating else min(least, steps)
        if ran < self.tp.batches or least < self.tp.steps:
            self._say_cut(epoch, ran, least if ran else 0)
        if hint := self.hints.after(epoch, reports, self.tp):
            self.ctx.sink.emit(hint)
        return ran

    def _batch(self, idx: Tensor, steps: int) -> TeleportReport:
        config = self.config if steps == self.config.steps else dataclasses.replace(self.config, steps=steps)
        if self.tp.method == "symmetry":  # single-process algorithm: every rank runs it on the whole batch
            x, y = to_device(sample_batch(self.train, idx), self.ctx.device, self.dtype)
            return symmetry_teleport_batch(self.model, self.loss_fn, x, y, config, holdout=self.holdout)
        # each rank takes its shard; teleport all-reduces so every rank ends bit-identical
        shard = idx[self.ctx.rank :: self.ctx.world_size] if self.sharded else idx
        x, y = to_device(sample_batch(self.train, shard), self.ctx.device, self.dtype)
        return teleport_batch(self.model, self.loss_fn, x, y, config, executor=self.executor,
                              holdout=self.holdout, comm=self.ctx.comm)

    def saved(self) -> dict[str, float]:
        """What a resumed run needs to go on with the same budget (kept in the checkpoint)."""
        return {"work_units": self.budget.work_units, "work_seconds": self.budget.work_seconds, "cuts": self.cuts}

    def restore(self, saved: dict[str, float] | None) -> None:
        if saved:
            self.budget.work_units, self.budget.work_seconds = saved["work_units"], saved["work_seconds"]
            self.cuts = int(saved["cuts"])

    def summary(self) -> dict[str, Any]:
        """The budget's fields of the run's summary: the share allowed and how many epochs it cut short."""
        return {"teleport_budget": self.budget.share, "teleport_cuts": self.cuts}

    def _say_cut(self, epoch: int, ran: int, least: int) -> None:
        self.cuts += 1
        self.ctx.sink.emit(cut_event(epoch, self.budget.share or 0.0, (self.tp.batches, self.tp.steps), (ran, least)))
