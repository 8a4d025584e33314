"""Step 3's ascent of one teleport batch: its state (``AscentBatch``), and the interface every way of taking its steps
implements (``Ascent``): the host guard (``teleport.ascent.host``), the device ticks and their CUDA graph
(``teleport.ascent.graphs``), chosen in one place (``teleport.ascent.choose``).

A batch starts from the objective at the weights as they are (L₀, ‖∇L‖²₀, this batch's CAP), decides before any
basis whether it can move at all (``decide_early``), keeps the blocks that have a free direction (``moving``), and
its ascent then takes up to t projected steps along U = π(H·∇L), each held to the rules of ``teleport.ascent.rules``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from torch import Tensor, nn

from teleport.ascent.rules import AimScale, early_reason
from teleport.config import TeleportConfig
from teleport.distributed import Collective, any_across_
from teleport.geometry.blocks import Block, moving_blocks
from teleport.hvp.difference import Shifted, ShiftScale
from teleport.hvp.direction import Direction, direction
from teleport.hvp.objective import HostReads, LossFn, Objective

Evaluate = Callable[..., Objective]  # (graph=, fetch=, recorder=) -> the objective at the weights as they are, read
Tensors = Callable[[bool], tuple[Objective, Tensor]]  # graph? -> (its gradients, [‖∇L‖², L] on the device, unread)


class AscentBatch:
    """One teleport batch once its blocks are built: the objective now, its CAP, the steps and back-offs so far."""

    def __init__(self, model: nn.Module, params: list[Tensor], blocks: list[Block], cur: Objective,
                 config: TeleportConfig, comm: Collective | None, loss_fn: LossFn, aim: AimScale,
                 shifted: Shifted | None = None, scale: ShiftScale | None = None,
                 reads: HostReads | None = None) -> None:
        self.model, self.params, self.blocks, self.cur, self.loss_fn = model, params, blocks, cur, loss_fn
        # ‖∇L‖² at the start not read (``recorded_loss``): the first tick of a replayed graph reads it, else ``undefer``
        self.deferred = math.isnan(cur.grad_norm_sq)
        self.asked = config
        self.config, self.comm = config.for_batch(cur.grad_norm_sq), comm  # this batch's CAP (``cap_ratio``)
        self.shifted = shifted  # ∇L at a shifted point, for H·∇L by a difference (``teleport.hvp.difference``)
        self.scale = scale  # the model's learned shift of a difference
        self.aim = aim  # the model's factor on a step aimed at CAP, learned (``rules.AimScale``)
        self.reads = reads
        self.loss0, self.gn0 = cur.loss, cur.grad_norm_sq
        self.steps = self.backoffs = 0
        self.weights: list[Tensor] = []  # the moving blocks' parameters, once ``moving`` chose them
        self.ascent = "host"  # how the steps ran (``choose.ascent_mode``)
        self.graph_replayed = False  # a graph captured for an earlier batch served this one (``graphs``)
        if comm is not None and comm.world_size > 1:  # rows looked up on any rank stay fixed on all
            any_across_(comm, [b.frozen for b in blocks if b.frozen is not None])

    def decide_early(self) -> str:
        """Why no step can be taken, known before any basis is built (else "steps")."""
        if reason := early_reason(self.loss0, 0.0 if self.deferred else self.gn0, self.config.cap):
            return reason  # a deferred start: its ‖∇L‖² (CAP, finite) is the first tick's to judge
        return "no_free_directions" if not self.blocks else "steps"

    def moving(self) -> str | None:
        """Keep the blocks a step moves (a free direction: ``moving_blocks``); why no step is taken, else None."""
        self.blocks = moving_blocks(self.blocks, self.config.tau, self.config.tau_rule)
        if not self.blocks:
            return "no_free_directions"
        if self.config.steps == 0:
            return "steps"
        self.weights = [p for b in self.blocks for p in b.params]
        return None

    def undefer(self, evaluate: Evaluate, graph: bool = True) -> str | None:
        """A deferred start read eagerly (``graph``: with ∇L's graph, for step 1) when no tick read it, and the early
        reason it gives (CAP, not finite), as ``decide_early`` would have; None for a start already read."""
        if not self.deferred:
            return None
        self.cur, self.deferred = evaluate(graph=graph), False
        self.loss0, self.gn0 = self.cur.loss, self.cur.grad_norm_sq
        self.config = self.asked.for_batch(self.gn0)
        return early_reason(self.loss0, self.gn0, self.config.cap)

    def started(self, loss0: float, gn0: float) -> None:
        """The start as a device tick found it (a deferred start read by the first replayed tick)."""
        self.loss0, self.gn0 = loss0, gn0
        self.config, self.deferred = self.asked.for_batch(gn0), False

    def direction(self, comm: Collective | None) -> Direction:
        """π(H·∇L) of an objective, with the H·∇L the config asks for (``teleport.hvp.direction``)."""
        return direction(self.blocks, self.weights, self.params, self.config, comm, self.shifted, self.scale)


class Ascent(Protocol):
    """A way to take a batch's steps: from ``batch.cur`` up to ``batch.config.steps`` projected steps, each held to
    the rules; the weights end at the last accepted step, ``batch`` says where (cur, steps, back-offs, ascent).
    Returns why it stopped: "steps", "cap", "loss_tol", "no_ascent", "not_finite"."""

    def __call__(self, batch: AscentBatch, evaluate: Evaluate, tensors: Tensors) -> str: ...
