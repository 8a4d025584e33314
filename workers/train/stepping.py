"""One optimizer step of the built-in loop: the batches whose gradients add up to it (``training.grad_accumulation``),
then the gradients clipped to ``training.grad_clip_norm``, the optimizer's step, the learning rate moved along
``optimizer.schedule``; and what an epoch record says of them.

The norms are summed on the device (no host sync per step), read once an epoch. Under DDP the gradients are
all-reduced before the clip, so every rank clips the same gradients by the same factor and the replicas stay
identical.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from api_schemas.spec import ExperimentSpec
from workers.train.build import build_lr_schedule, grad_scaler


def epoch_length(samples: int, batch_size: int, world_size: int, limit: int | None, accumulate: int) -> tuple[int, int]:
    """(batches, optimizer steps) of one epoch on each rank: the rank's ``ceil(samples / world_size)`` samples in
    batches of ``batch_size`` (the last may be short), ``accumulate`` batches a step, at most ``limit`` steps.

    >>> epoch_length(300, 16, 1, None, 2), epoch_length(300, 16, 2, 3, 2)
    ((19, 10), (6, 3))
    """
    batches = max(1, math.ceil(math.ceil(samples / world_size) / batch_size))
    steps = min(math.ceil(batches / accumulate), limit or batches)
    return min(batches, steps * accumulate), steps


def accumulated(loader: DataLoader, accumulate: int) -> Iterator[tuple[Any, float, bool]]:
    """Each batch of ``loader`` with its share of its step's samples (what its mean loss is scaled by, so that a
    step's gradient is the mean over all its samples, as one batch of them would give) and whether the optimizer
    steps after it (its step's last batch; the epoch's last step may have fewer batches, its last a short one)."""
    samples, size, batches = len(loader.sampler), loader.batch_size or 1, len(loader)  # type: ignore[arg-type]
    for i, batch in enumerate(loader):
        first = i - i % accumulate
        last = min(first + accumulate, batches) - 1
        in_step = min(samples, (last + 1) * size) - first * size  # batches first..last: full, the epoch's last short
        yield batch, min(size, samples - i * size) / in_step, i == last


@dataclass
class Stepper:
    """Steps ``optimizer`` for the loop; ``steps`` counts every step of the run (a resumed run's included), what the
    schedule reads and a checkpoint keeps. With ``training.precision: fp16`` a ``GradScaler`` scales each loss before
    its backward and unscales the gradients before the clip; a step whose gradients overflowed is skipped by it."""

    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    clip: float | None
    schedule: torch.optim.lr_scheduler.LambdaLR | None
    scaler: torch.amp.GradScaler | None
    steps: int
    lr: float = 0.0  # the learning rate of the last step taken
    _norms: torch.Tensor | None = field(default=None, repr=False)  # [Σ finite norms, finite norms, clipped]

    @classmethod
    def build(cls, spec: ExperimentSpec, optimizer: torch.optim.Optimizer, net: nn.Module, device: torch.device,
              total: int, done: int = 0, scale: dict[str, Any] | None = None) -> Stepper:
        """For a run of ``total`` optimizer steps, ``done`` of them taken (a resumed run: its start epoch's), with
        fp16's loss scale ``scale`` (a checkpoint's ``grad_scaler``) when it has one."""
        schedule = build_lr_schedule(spec.optimizer, optimizer, total, done)
        scaler = grad_scaler(spec.training, device)
        if scaler is not None and scale:
            scaler.load_state_dict(scale)
        return cls(optimizer, list(net.parameters()), spec.training.grad_clip_norm, schedule, scaler, done,
                   lr=float(optimizer.param_groups[0]["lr"]))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the steps taken (a record: a resume counts them from its epoch), the loss scale
        (fp16)."""
        return {"optimizer_steps": self.steps,
                **({"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {})}

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self) -> None:
        """Clip (when asked), step the optimizer (unless fp16's gradients overflowed), move the learning rate."""
        if self.clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip the gradients, not the scaled ones
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip).detach().double()
            finite = torch.isfinite(norm)  # an overflowed fp16 step: skipped, not counted
            row = torch.stack([torch.where(finite, norm, 0.0), finite.double(), (finite & (norm > self.clip)).double()])
            self._norms = row if self._norms is None else self._norms + row
        self.lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if self.schedule is not None:
            self.schedule.step()
        self.steps += 1

    def report(self) -> dict[str, Any]:
        """What the record of the steps since the last report says: ``lr`` (the last step's) when the rate moves,
        ``grad_norm`` (the mean norm before clipping) and ``clipped`` (the share of steps clipped) when clipping."""
        out: dict[str, Any] = {"lr": self.lr} if self.schedule is not None else {}
        if self._norms is not None:
            total, counted, clipped = self._norms.tolist()
            if counted:
                out["grad_norm"], out["clipped"] = total / counted, clipped / counted
        self._norms = None
        return out
