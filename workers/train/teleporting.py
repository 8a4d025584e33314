"""The one teleport driver of a run, for our loop (``workers.train.loop``) and a user's own loop
(``workers.train.own_loop``'s ``ctx.teleport``) alike: one scheduled epoch's teleport (paper, Algorithm 1), b batches
of n training samples, t ascent steps each, within the run's wall-clock budget (``workers.train.budget``), by one
``teleport.Teleporter`` kept for the run and saved in its checkpoint (a resumed run takes the teleports the run
without the interruption would have taken). Every record goes to the run's sink:

- ``{"kind": "teleport", "epoch", "batch", **TeleportReport.to_dict()}`` per teleport batch;
- ``{"kind": "budget", "epoch", "message", ...}`` when the budget shortened or skipped the epoch's teleport, and, once,
  when a teleport made no move for a reason that holds for the next ones: at CAP, the epoch's other batches are
  skipped and then teleport epochs in doubling runs while the model stays at CAP (``TeleportRunner._at_cap``); with
  no free direction, or every try of an epoch refused, the run's later teleports are skipped
  (``teleport_hints.stuck_record``, ``refused_record``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate

from api_schemas.spec import TeleportSpec
from teleport import BasisExecutor, TeleportConfig, Teleporter, TeleportReport, symmetry_teleport_batch
from workers.train.budget import FIRST_UNIT_PER_STEP, TeleportBudget, agree_across, cut_event, probe_seconds
from workers.train.context import RunContext
from workers.train.teleport_hints import IdleHints, refused_record, stuck_record, teleport_record


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


class TeleportDiverged(RuntimeError):
    """A teleport batch ended with a non-finite loss (the loop turns it into TrainingDiverged)."""

    def __init__(self, batch: int, loss: float) -> None:
        super().__init__(f"teleport batch {batch}")
        self.batch, self.loss = batch, loss


def draw(dataset: Dataset, tp: TeleportSpec, seed: int, epoch: int, rank: int = 0,
         world_size: int = 1) -> Iterator[tuple[Tensor, Tensor]]:
    """An epoch's ``teleport.batches`` random batches of ``teleport.batch_size`` samples: the same draw on every rank
    (seeded by the run's seed and the epoch), each rank taking its shard (``world_size`` 1: the whole batch)."""
    if world_size > 1 and tp.batch_size < world_size:
        raise ValueError(f"teleport.batch_size={tp.batch_size} is below resources.workers={world_size}: "
                         "every rank needs a share of the teleport batch")
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    for _ in range(tp.batches):
        idx = torch.randperm(len(dataset), generator=g)[: tp.batch_size]  # type: ignore[arg-type]
        yield sample_batch(dataset, idx[rank::world_size])


@dataclass
class TeleportRunner:
    """A run's teleports: its ``Teleporter`` (the model's teleport state), budget, cuts and what it said (see the
    module). ``model`` is the bare module (never a DDP wrapper): teleport moves it."""

    tp: TeleportSpec
    config: TeleportConfig
    ctx: RunContext
    dtype: torch.dtype
    budget: TeleportBudget
    executor: BasisExecutor | None = None
    cuts: int = 0
    skipped: dict[str, Any] | None = None  # the no-move record after which the run's teleports stopped
    idle: str | None = None  # the first no-move message of the run (said once)
    idle_batches: int = 0  # planned teleport batches not run because one made no move
    capped: int = 0  # teleport epochs in a row that ended at CAP
    waiting: int = 0  # scheduled teleport epochs still to skip after the last one at CAP
    hints: IdleHints = dataclasses.field(default_factory=IdleHints)
    teleporter: Teleporter | None = None
    _state: dict[str, Any] | None = None  # a checkpoint's teleporter state, for the first teleporter made

    @property
    def sharded(self) -> bool:
        """Each rank teleports its shard of the batch (the null-space teleport across DDP ranks)."""
        return self.ctx.comm is not None and self.ctx.world_size > 1 and self.tp.method == "nullspace"

    def draw(self, dataset: Dataset, seed: int, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The epoch's teleport batches from ``dataset`` (``draw``): this rank's shard, or the whole batch (the
        symmetry teleport is single-process: every rank runs it on the whole batch)."""
        return draw(dataset, self.tp, seed, epoch, *((self.ctx.rank, self.ctx.world_size) if self.sharded else ()))

    def probe(self, net: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], train: Dataset, batch_size: int,
              batches_per_epoch: int) -> None:
        """Before any epoch ran: time one forward + backward on a training batch (eval mode: no running
        statistic moves), to project the run's length and a teleport unit's cost."""
        if self.budget.share is None or self.budget.probe_epoch_s is not None:
            return
        idx = torch.arange(min(batch_size, len(train)))  # type: ignore[arg-type]
        x, y = to_device(sample_batch(train, idx), self.ctx.device, self.dtype)
        was = net.training
        net.eval()

        def step() -> None:
            loss_fn(net(x), y).backward()
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

    def run(self, epoch: int, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor],
            batches: Iterable[tuple[Tensor, Tensor]], spent: float, train_seconds: float, epochs_done: int,
            holdout: tuple[Tensor, Tensor] | None = None) -> list[TeleportReport]:
        """Teleport on up to ``tp.batches`` of ``batches`` (this rank's (x, y), any device); returns their reports.
        ``spent``: teleport seconds of the run before this call; ``train_seconds``: its seconds outside teleport over
        ``epochs_done`` epochs. Nothing once a teleport made no move (``skipped``)."""
        if self.skipped is not None:
            return []
        if self.waiting > 0:  # the model was at CAP lately: this teleport epoch is skipped (see ``_at_cap``)
            self.waiting -= 1
            self.idle_batches += self.tp.batches
            return []
        start, reports, least, stopped = time.perf_counter(), [], self.tp.steps, False
        for i, batch in zip(range(self.tp.batches), batches, strict=False):
            steps = self.budget.steps_for_batch(self.tp.steps, spent + time.perf_counter() - start, train_seconds,
                                                epochs_done, agree_across(self.ctx))
            if steps == 0:
                break
            calibrating = self.budget.calibrates(steps, self.tp.steps)
            x, y = to_device(batch, self.ctx.device, self.dtype)
            report = self._batch(model, loss_fn, x, y, steps, holdout)
            self.ctx.sink.emit(teleport_record(epoch, i, report, calibrating))
            if not math.isfinite(report.loss_after):
                raise TeleportDiverged(i, report.loss_after)
            self.budget.record(report)
            reports.append(report)
            least = least if calibrating else min(least, steps)
            if (stuck := stuck_record(epoch, report, self.tp)) is not None:
                stopped = True
                self.idle_batches += self.tp.batches - len(reports)
                if stuck["stop_reason"] == "cap":  # this epoch's batches are at CAP too; a later epoch checks again
                    self._at_cap(stuck)
                else:
                    self._skip(stuck)
                break
        if self.skipped is None and (refused := refused_record(epoch, reports)) is not None:
            self._skip(refused)
        if reports and not stopped:
            self.capped = 0  # the epoch ended below CAP: the next one teleports as planned
        if self.skipped is None and not stopped and (len(reports) < self.tp.batches or least < self.tp.steps):
            self._say_cut(epoch, len(reports), least if reports else 0)
        if hint := self.hints.after(epoch, reports, self.tp):
            self.ctx.sink.emit(hint)
        return reports

    def _batch(self, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, y: Tensor, steps: int,
               holdout: tuple[Tensor, Tensor] | None) -> TeleportReport:
        config = self.config if steps == self.config.steps else dataclasses.replace(self.config, steps=steps)
        if self.tp.method == "symmetry":  # single-process algorithm: every rank runs it on the whole batch
            return symmetry_teleport_batch(model, loss_fn, x, y, config, holdout=holdout)
        if self.teleporter is None or self.teleporter.model is not model or self.teleporter.loss_fn is not loss_fn:
            self.teleporter = Teleporter(model, loss_fn, self.config, executor=self.executor,
                                         comm=self.ctx.comm if self.sharded else None)
            if self._state is not None:
                self.teleporter.load_state_dict(self._state)
                self._state = None
        return self.teleporter.teleport(x, y, holdout=holdout, config=config)

    def saved(self) -> dict[str, Any]:
        """What a resumed run needs to go on with the same budget and the same teleports (kept in the checkpoint)."""
        teleporter = self.teleporter.state_dict() if self.teleporter is not None else self._state
        return {"work_units": self.budget.work_units, "work_seconds": self.budget.work_seconds, "cuts": self.cuts,
                "skipped": self.skipped, "idle": self.idle, "idle_batches": self.idle_batches,
                "capped": self.capped, "waiting": self.waiting,
                "teleporter": teleporter}

    def restore(self, saved: dict[str, Any] | None) -> None:
        if saved:
            self.budget.work_units, self.budget.work_seconds = saved["work_units"], saved["work_seconds"]
            self.cuts, self.skipped = int(saved["cuts"]), saved.get("skipped")
            self.idle, self.idle_batches = saved.get("idle"), int(saved.get("idle_batches", 0))
            self.capped, self.waiting = int(saved.get("capped", 0)), int(saved.get("waiting", 0))
            self._state = saved.get("teleporter")

    def summary(self) -> dict[str, Any]:
        """The budget's fields of the run's summary: the share allowed, how many epochs it cut short, and why the
        teleports stopped early when one made no move."""
        return {"teleport_budget": self.budget.share, "teleport_cuts": self.cuts, "teleport_skipped": self.idle,
                "teleport_skipped_batches": self.idle_batches}

    def _skip(self, record: dict[str, Any]) -> None:
        """No later teleport of the run runs (``run`` returns at once): a teleport could not move (see the module)."""
        self.skipped = record
        self._say_idle(record)

    def _at_cap(self, record: dict[str, Any]) -> None:
        """The epoch's teleport stopped at a batch already at CAP: after the c-th such epoch in a row the next 2^c − 1
        scheduled teleport epochs are skipped (1, 3, 7, ...), so a model that stays at CAP costs a few plain forward +
        backward passes a run, and one that trained back under it teleports again."""
        self.capped += 1
        self.waiting = 2**self.capped - 1
        self._say_idle(record)

    def _say_idle(self, record: dict[str, Any]) -> None:
        """The first no-move record of the run goes to its events; the summary keeps its message."""
        if self.idle is None:
            self.idle = record["message"]
            self.ctx.sink.emit(record)

    def _say_cut(self, epoch: int, ran: int, least: int) -> None:
        self.cuts += 1
        self.ctx.sink.emit(cut_event(epoch, self.budget.share or 0.0, (self.tp.batches, self.tp.steps), (ran, least)))
