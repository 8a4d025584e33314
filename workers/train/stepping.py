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
from workers.train.build import build_lr_schedule


def epoch_length(samples: int, batch_size: int, world_size: int, limit: int | None, accumulate: int) -> tuple[int, int]:
    """(batches, optimizer steps) of one epoch on each rank: the rank's ``ceil(samples / world_size)`` samples in
    batches of ``batch_size`` (the last may be short), ``accumulate`` batches a step, at most ``limit`` steps.

    >>> epoch_length(300, 16, 1, None, 2), epoch_length(300, 16, 2, 3, 2)
    ((19, 10), (6, 3))
    """
    batches = max(1, math.ceil(math.ceil(samples / world_size) / batch_size))
    steps = math.ceil(batches / accumulate) if limit is None else min(math.ceil(batches / accumulate), limit)
    return min(batches, steps * accumulate), steps


def accumulated(loader: DataLoader, accumulate: int) -> Iterator[tuple[Any, float, bool]]:
    """Each batch of ``loader`` with its share of its step's samples (what its mean loss is scaled by, so that a
    step's gradient is the mean over all its samples, as one batch of them would give) and whether the optimizer
    steps after it (its step's last batch; the epoch's last step may have fewer batches, its last a short one)."""
    samples, size, batches = len(loader.sampler), loader.batch_size or 1, len(loader)  # type: ignore[arg-type]

    def count(j: int) -> int:  # samples in batch j: batch_size, the last one what is left
        return min(size, samples - j * size)

    for i, batch in enumerate(loader):
        first = i - i % accumulate
        last = min(first + accumulate, batches) - 1
        yield batch, count(i) / sum(count(j) for j in range(first, last + 1)), i == last


@dataclass
class Stepper:
    """Steps ``optimizer`` for the loop; ``steps`` counts every step of the run (a resumed run's included), what the
    schedule reads and a checkpoint keeps."""

    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    clip: float | None
    schedule: torch.optim.lr_scheduler.LambdaLR | None
    steps: int
    lr: float = 0.0  # the learning rate of the last step taken
    _norms: torch.Tensor | None = field(default=None, repr=False)
    _clipped: torch.Tensor | None = field(default=None, repr=False)
    _counted: int = 0

    @classmethod
    def build(cls, spec: ExperimentSpec, optimizer: torch.optim.Optimizer, net: nn.Module, total: int,
              done: int) -> Stepper:
        """For a run of ``total`` optimizer steps of which ``done`` were taken before (a checkpoint's)."""
        schedule = build_lr_schedule(spec.optimizer, optimizer, total, done)
        return cls(optimizer, list(net.parameters()), spec.training.grad_clip_norm, schedule, done,
                   lr=float(optimizer.param_groups[0]["lr"]))

    def step(self) -> None:
        """Clip (when asked), step the optimizer, move the learning rate."""
        if self.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip).detach().double()
            self._norms = norm if self._norms is None else self._norms + norm
            over = (norm > self.clip).double()
            self._clipped = over if self._clipped is None else self._clipped + over
            self._counted += 1
        self.lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        if self.schedule is not None:
            self.schedule.step()
        self.steps += 1

    def report(self) -> dict[str, Any]:
        """What the record of the steps since the last report says: ``lr`` (the last step's) when the rate moves,
        ``grad_norm`` (the mean norm before clipping) and ``clipped`` (the share of steps clipped) when clipping."""
        out: dict[str, Any] = {"lr": self.lr} if self.schedule is not None else {}
        if self._norms is not None and self._clipped is not None and self._counted:
            out["grad_norm"] = float(self._norms) / self._counted
            out["clipped"] = float(self._clipped) / self._counted
        self._norms, self._clipped, self._counted = None, None, 0
        return out
