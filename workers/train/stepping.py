"""One optimizer step of the built-in loop, after the backward: the gradients clipped to ``training.grad_clip_norm``,
the optimizer's step, the learning rate moved along ``optimizer.schedule``; and what an epoch record says of them.

The norms are summed on the device (no host sync per step), read once an epoch. Under DDP the gradients are
all-reduced before the clip, so every rank clips the same gradients by the same factor and the replicas stay
identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from api_schemas.spec import ExperimentSpec
from workers.train.build import build_lr_schedule


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
