"""Step 3's ascent of one teleport batch: the host guard's steps or the device ticks, and what they step along.

``Run`` holds a batch's state once its blocks are built: the objective now, its CAP, steps and back-offs. It takes
the steps by the host guard (``_steps``: Python decides on L and ‖∇L‖² read after every try, ``teleport.guard``) or
hands them to the device ticks (``teleport.on_device``), replayed from the model's CUDA graph where one serves the
batch (``teleport.graph_cache``) — how, ``ascent_mode`` decides. The direction is π(H·∇L): the double backward's
(``ascent_direction``) or a difference of gradients' (``difference_direction``, ``teleport.difference``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from torch import Tensor, nn

from teleport import graph_cache
from teleport.aim import aim_on_device, aim_scale
from teleport.blocks import Block, moving_blocks
from teleport.buffers import StepBuffers
from teleport.difference import Shifted, ShiftScale, difference_hvp, shift_scale
from teleport.distributed import Collective, any_across_
from teleport.factored import factored_direction
from teleport.guard import guarded_step
from teleport.objective import LossFn, Objective, teleport_gradient, teleport_gradient_and
from teleport.on_device import UNCAPTURABLE, DeviceAscent, Evaluate
from teleport.report import TeleportConfig


class Run:
    """The state of one teleport: the blocks that move, the objective now, steps and back-offs so far."""

    def __init__(self, model: nn.Module, params: list[Tensor], blocks: list[Block], cur: Objective,
                 config: TeleportConfig, comm: Collective | None, shifted: Shifted | None = None,
                 loss_fn: LossFn | None = None) -> None:
        self.model, self.params, self.blocks, self.cur, self.loss_fn = model, params, blocks, cur, loss_fn
        # ‖∇L‖² at the start not read (``recorded_loss``): the first tick of a replayed graph reads it, else ``undefer``
        self.deferred = math.isnan(cur.grad_norm_sq)
        self.asked = config
        self.config, self.comm = config.for_batch(cur.grad_norm_sq), comm  # this batch's CAP (``cap_ratio``)
        self.shifted = shifted  # ∇L at a shifted point, for H·∇L by a difference (``teleport.difference``)
        self.scale = shift_scale(model, params[0]) if shifted is not None else None  # the model's learned shift
        self.aim = aim_scale(model, params[0])  # the model's factor on a step aimed at CAP, learned (``teleport.aim``)
        self.loss0, self.gn0 = cur.loss, cur.grad_norm_sq
        self.steps = self.backoffs = 0
        self.ascent = "host"  # how the steps ran (``ascent_mode``)
        self.graph_replayed = False  # a graph captured for an earlier batch served this one (``graph_cache``)
        if comm is not None and comm.world_size > 1:  # rows looked up on any rank stay fixed on all
            any_across_(comm, [b.frozen for b in blocks if b.frozen is not None])

    def decide_early(self) -> str:
        """Why no step can be taken, known before any basis is built (else "steps")."""
        if reason := early_reason(self.loss0, 0.0 if self.deferred else self.gn0, self.config.cap):
            return reason  # a deferred start: its ‖∇L‖² (CAP, finite) is the first tick's to judge
        if not self.blocks or self.config.steps == 0:
            return "no_free_directions" if not self.blocks else "steps"
        return "steps"

    def ascend(self, evaluate: Callable[..., Objective], tensors: Evaluate) -> str:
        blocks = moving_blocks(self.blocks, self.config.tau, self.config.tau_rule)
        if not blocks:
            return "no_free_directions"
        if self.config.steps == 0:
            return "steps"
        weights = [p for b in blocks for p in b.params]
        self.ascent = ascent_mode(self.config, weights[0].device, self.comm, self.model)
        if self.ascent != "host":
            return self._on_device(blocks, weights, tensors, evaluate)
        if reason := self.undefer(evaluate):  # the host guard steps from a start it has read
            return reason
        buffers = StepBuffers(weights)
        try:
            return self._steps(blocks, weights, buffers, evaluate)
        finally:
            buffers.finish()

    def undefer(self, evaluate: Callable[..., Objective], graph: bool = True) -> str | None:
        """A deferred start read eagerly (``graph``: with ∇L's graph, for step 1) when no tick read it, and the early
        reason it gives (CAP, not finite), as ``decide_early`` would have; None for a start already read."""
        if not self.deferred:
            return None
        self.cur, self.deferred = evaluate(graph=graph), False
        self.loss0, self.gn0 = self.cur.loss, self.cur.grad_norm_sq
        self.config = self.asked.for_batch(self.gn0)
        return early_reason(self.loss0, self.gn0, self.config.cap)

    def _on_device(self, blocks: list[Block], weights: list[Tensor], tensors: Evaluate,
                   evaluate: Callable[..., Objective]) -> str:
        """The steps as device ticks (``teleport.on_device``), captured in a CUDA graph in mode "cuda_graph"."""
        direction = self._direction(blocks, weights, None)  # the ticks are single-process
        # a model whose tick could not be captured has no static inputs (``teleport_batch``): never replayed
        graphed = self.ascent == "cuda_graph" and self.model not in UNCAPTURABLE
        graph_key = graph_cache.key(self.config, self.loss_fn, self.params, blocks) if graphed else ()
        ascent = graph_cache.reused(self.model, graph_key, blocks, self.cur, self.config) if graphed else None
        if ascent is None and (reason := self.undefer(evaluate)):  # no graph serves the batch after all
            return reason
        fresh = ascent is None
        self.graph_replayed = not fresh
        commit = self.scale.commit if self.scale is not None else None
        ascent = ascent or DeviceAscent(weights, tensors, direction, self.cur, self.config, commit, self.aim)
        reason = ascent.run(graphs=graphed, owner=self.model,
                            warm=graphed and graph_cache.warmed(self.model, graph_key))
        if graphed and fresh:
            graph_cache.keep(self.model, graph_key, blocks, ascent)
            if ascent.warmed:
                graph_cache.warm(self.model, graph_key)
        if graphed and ascent.graph is not None:
            graph_cache.counted(self.model, replayed=not fresh)
        if self.model in UNCAPTURABLE:
            graph_cache.release(self.model)  # a graph kept for an earlier batch must not serve a later one
        self.ascent = ascent.mode  # "device" when the capture failed
        self.steps, self.backoffs, loss, gn = ascent.result()
        self.cur = replace(self.cur, loss=loss, grad_norm_sq=gn)
        if self.deferred:  # the first replayed tick read the start
            self.loss0, self.gn0 = ascent.started()
            self.config, self.deferred = self.asked.for_batch(self.gn0), False
        return reason

    def _direction(self, blocks: list[Block], weights: list[Tensor],
                   comm: Collective | None) -> Callable[[Objective], list[Tensor]]:
        """π(H·∇L) of an objective, with the H·∇L the config asks for."""
        if self.shifted is not None:
            return partial(difference_direction, blocks=blocks, weights=weights, params=self.params,
                           shifted=self.shifted, scale=self.scale)
        return partial(ascent_direction, blocks=blocks, weights=weights, params=self.params, comm=comm,
                       config=self.config)

    def _steps(self, blocks: list[Block], weights: list[Tensor], buffers: StepBuffers,
               evaluate: Callable[..., Objective]) -> str:
        eta = self.config.lr
        direction_of = self._direction(blocks, weights, self.comm)
        while self.steps < self.config.steps:
            if self.cur.grad_norm_sq >= self.config.cap:
                return "cap"
            direction = direction_of(self.cur)
            if self.scale is not None:  # a direction that starts a step: the difference's proposed shift kept
                self.scale.commit()
            last = self.steps + 1 == self.config.steps  # no H·∇L follows the last step: its graph is not kept
            # the first try's η is decided on the device and read back with its L and ‖∇L‖²: one sync a step
            eta_t, aimed_t, slope_t = aim_on_device(eta, self.cur.grad_norm_sq, direction, self.config.cap,
                                                    self.config.rise, self.aim)
            buffers.move(direction, eta_t)
            first = evaluate(graph=not last, fetch=(eta_t, aimed_t, slope_t))
            try_eta, aimed, slope = first.fetched[0], bool(first.fetched[1]), first.fetched[2]
            new, used, tries, why = guarded_step(
                partial(buffers.move, direction), buffers.restore,
                partial(evaluate, graph=not last), self.loss0, try_eta, self.config, self.cur.grad_norm_sq,
                final_evaluate=partial(evaluate, graph=False), aimed=aimed, first=first, slope=slope)
            eta = used if not aimed else eta
            self.backoffs += tries
            if new is None:
                return why
            if aimed:  # it landed: what it took teaches the model's next aim
                self.aim.learn(None, eta_t, used, new.grad_norm_sq - self.cur.grad_norm_sq,
                               self.config.cap - self.cur.grad_norm_sq)
            buffers.accept()
            self.cur, self.steps = new, self.steps + 1
            if why == "cap":  # shortened to fit under CAP: CAP is reached, further steps would overshoot
                return "cap"
        return "steps"


def early_reason(loss: float, grad_norm_sq: float, cap: float) -> str | None:
    """Why a batch of this L and ‖∇L‖² takes no step whatever its bases: "not_finite", "cap", else None."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm_sq)):
        return "not_finite"
    return "cap" if grad_norm_sq >= cap else None


def difference_direction(obj: Objective, blocks: list[Block], weights: list[Tensor], params: list[Tensor],
                          shifted: Shifted, scale: ShiftScale | None = None) -> list[Tensor]:
    """π(H·∇L) with H·∇L from a difference of gradients (``teleport.difference``; ``scale``: its shift's learned
    factor)."""
    return project_blocks(blocks, difference_hvp(obj, params, weights, shifted, scale), inplace=True)


def ascent_direction(obj: Objective, blocks: list[Block], weights: list[Tensor], params: list[Tensor],
                     comm: Collective | None, config: TeleportConfig) -> list[Tensor]:
    """π(H·∇L) for every moving weight, block by block, from the objective's graph."""
    if not exact_tau(config):
        return project_blocks(blocks, teleport_gradient(obj, weights, params, comm), inplace=True)
    return factored_direction(obj, blocks, comm, teleport_gradient_and, project_blocks)


def ascent_mode(config: TeleportConfig, device: torch.device, comm: Collective | None,
                model: nn.Module | None = None) -> str:
    """How the steps run: "host" (the guard in Python, ``_steps``), "device" (device ticks) or "cuda_graph"
    (device ticks replayed from a CUDA graph: ``teleport.on_device``), with either H·∇L. "auto": on CUDA the CUDA
    graph (on an H200 8 forced steps of a GPT-style LM 9.3 training steps against the host guard's 30.8, 3 launches
    a step), the host guard for a model whose tick a graph could not hold (``UNCAPTURABLE``: faster than the eager
    ticks) or whose batches' shapes keep changing (``graph_cache.churning``: no graph would replay), and without
    CUDA (the fastest on the CPU); across ranks always the host guard (the ticks are single-process)."""
    if comm is not None and comm.world_size > 1:
        return "host"
    if config.ascent == "auto":
        graphs = model is None or (model not in UNCAPTURABLE and not graph_cache.churning(model))
        return "cuda_graph" if device.type == "cuda" and graphs else "host"
    return "device" if config.ascent == "cuda_graph" and device.type != "cuda" else config.ascent


def exact_tau(config: TeleportConfig) -> bool:
    """τ = 1 read as the numerical rank: π removes all of the inputs' span (``teleport.spanfree`` applies)."""
    return config.tau >= 1.0 and config.tau_rule == "numerical_rank"


def project_blocks(blocks: list[Block], grads: list[Tensor], inplace: bool = False) -> list[Tensor]:
    """π of each block's gradients; ``grads`` lists every block's params in order (overwritten if ``inplace``)."""
    out: list[Tensor] = []
    i = 0
    for b in blocks:
        out += b.projected(grads[i : i + len(b.params)], inplace)
        i += len(b.params)
    return out
