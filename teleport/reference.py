"""Algorithm 1 of the paper, as plainly as it can be written and still be exact: the oracle of every fast path.

For one teleport batch (x, y):

1. Capture. One forward records every use of every trainable parameter (``teleport.geometry.capture``): a weight's
   rows that share their uses form a row class, and the class' representation R stacks the input columns of each
   use (a row of ones under them where the use adds the bias) — eqs. 9-11, per parameter rather than per layer, so a
   tied or reused weight moves only where every use of it stays unchanged.
2. Bases. The SVD of each R in float64; the kept span B is its first k left singular vectors, k by the τ rule
   (eq. 3) and never past the numerical rank (``core_basis``).
3. Ascent. U = π(H·∇L), H·∇L = ∇(½‖∇L‖²) by one double backward, π(G) = G − (G B) Bᵀ per class (eqs. 12-17). A step
   tries W₀ + η·U and is held to the rules of ``teleport.ascent.rules``: accepted when L and ‖∇L‖² are finite,
   ‖∇L‖² ≤ CAP, |L − L₀| ≤ loss_tol·|L₀| and ‖∇L‖² rose; else shortened (the curve through an overshoot of CAP, or
   halved) up to ``max_backoff`` times, then given up. No step starts once ‖∇L‖² ≥ CAP (Algorithm 1's CAP).

Single process, ``hvp: "exact"`` only, no speed path: no span-free alias, no factors, no certificate, no batching,
no device ticks. ``tests/teleport/test_reference.py`` holds ``Teleporter`` to it on every model family of the tests.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from teleport.ascent.rules import AimScale, aim_on_device, early_reason, shorten, step_verdict
from teleport.config import TeleportConfig
from teleport.geometry.blocks import Block, build_blocks, partition
from teleport.geometry.capture import UseRecorder, trainable
from teleport.hvp.objective import LossFn
from teleport.modes import evaluating, ieee_float32
from teleport.report import TeleportReport


def reference_teleport(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, config: TeleportConfig | None = None,
                       aim: AimScale | None = None) -> TeleportReport:
    """Teleport ``model`` in place on (x, y) by Algorithm 1 (see the module). ``aim``: the factor a model's earlier
    steps aimed at CAP learned (``Teleporter.aim``; updated in place), 1 when None."""
    config = config or TeleportConfig()
    if config.hvp != "exact":
        raise ValueError("the reference computes H·∇L exactly: teleport.hvp must be 'exact'")
    start = time.perf_counter()
    with torch.autocast(x.device.type, enabled=False), ieee_float32(), evaluating(model):
        names, params = trainable(model)
        recorder = UseRecorder(names, params)
        loss, grads = evaluate(model, loss_fn, x, y, params, recorder)  # step 1: R from the same forward as L
        loss0, gn0 = float(loss), float(squared(grads))
        config = config.for_batch(gn0)  # this batch's CAP (cap_ratio)
        reason, steps, backoffs, now = early_reason(loss0, gn0, config.cap), 0, 0, (loss0, gn0)
        blocks = build_blocks(recorder.uses)[0]
        if reason is None and not blocks:
            reason = "no_free_directions"
        if reason is None:
            bases = [[core_basis(b.representation(c), config.tau, config.tau_rule) for c in _classes(b)]
                     for b in blocks]  # step 2
            if not any(k.shape[1] < k.shape[0] for ks in bases for k in ks):
                reason = "no_free_directions"
        if reason is None:  # step 3
            aim = aim or AimScale(x.device)
            reason, steps, backoffs, now = ascend(model, loss_fn, x, y, params, blocks, bases, config, loss0, gn0,
                                                  grads, aim)
    return TeleportReport(loss0, now[0], gn0, now[1], steps, backoffs, reason, time.perf_counter() - start)


def evaluate(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, params: list[Tensor],
             recorder: UseRecorder | None = None) -> tuple[Tensor, list[Tensor]]:
    """L and ∇L of every parameter, ∇L with its graph (for H·∇L). The math kernel of attention: the fused ones have
    no double backward."""
    with sdpa_kernel(SDPBackend.MATH):
        if recorder is None:
            loss = loss_fn(model(x), y)
        else:
            with recorder:
                loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def squared(tensors: list[Tensor]) -> Tensor:
    """Σ ‖g‖² in float64."""
    return sum((g.detach().double() ** 2).sum() for g in tensors)  # type: ignore[return-value]


def core_basis(rep: Tensor, tau: float, rule: str) -> Tensor:
    """B (d, k): the first k left singular vectors of R (d, N), float64 — eq. 3's smallest k whose σ₁² + … + σ_k²
    reach τ‖R‖²_F, never past the numerical rank (σ_i² > tol·σ₁², tol of a float64 Gram's eigenvalues: what every
    route of ``teleport.geometry.bases`` reads); ``rule`` "energy": eq. 3 summed in R's working precision alone."""
    u, s, _ = torch.linalg.svd(rep.double(), full_matrices=False)
    sq = s**2
    if float(sq.sum()) == 0.0:
        return u[:, :0]
    d, n = rep.shape
    working = torch.promote_types(rep.dtype, torch.float32)
    if rule == "energy":
        energy = torch.cumsum(sq.to(working), 0)
        return u[:, : min(int((energy < tau * energy[-1]).sum()) + 1, sq.numel())]
    tol = max((max(d, n) * torch.finfo(working).eps) ** 2, max(d, n) * torch.finfo(torch.float64).eps)
    rank = int((sq > tol * sq[0]).sum())
    energy = torch.cumsum(sq, 0)
    k = rank if tau >= 1.0 else min(int(torch.searchsorted(energy, tau * energy[-1])) + 1, rank)
    return u[:, :k]


def project(block: Block, bases: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    """π of [∇W | ∇b] class by class: G − (G B) Bᵀ on each class' rows; rows in no class (looked up by an embedding,
    read by no linear map) get 0."""
    g = block.matrix(grads[0]).double()  # (rows, C)
    if block.bias is not None:
        g = torch.cat([g, block.bias_per_row(grads[1]).double()[:, None]], dim=1)  # (rows, C + 1)
    out = torch.zeros_like(g)
    for cls, basis in zip(_classes(block), bases, strict=True):
        rows = slice(None) if cls.rows is None else cls.rows
        part = g[rows] - (g[rows] @ basis) @ basis.T
        out[rows] = part if cls.mask is None else torch.where(cls.mask[:, None], part, 0.0)
    w = block.unmatrix(out[:, : block.matrix(grads[0]).shape[1]].contiguous())
    moved = [w.to(block.weight.dtype)]
    if block.bias is not None:
        moved.append(block.bias_from_rows(out[:, -1].contiguous()).to(block.bias.dtype))
    return moved


def ascend(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, params: list[Tensor], blocks: list[Block],
           bases: list[list[Tensor]], config: TeleportConfig, loss0: float, gn0: float, grads: list[Tensor],
           aim: AimScale) -> tuple[str, int, int, tuple[float, float]]:
    """Up to ``config.steps`` projected steps from (L₀, ‖∇L‖²₀): (why it stopped, steps, back-offs, (L, ‖∇L‖²))."""
    weights = [p for b in blocks for p in b.params]
    steps = backoffs = 0
    gn, loss, eta = gn0, loss0, config.lr
    while steps < config.steps:
        if gn >= config.cap:
            return "cap", steps, backoffs, (loss, gn)
        hvp = second_backward(grads, weights)  # ∇(½‖∇L‖²) = H·∇L for the weights that move
        u, i = [], 0
        for b, bb in zip(blocks, bases, strict=True):
            u += project(b, bb, hvp[i : i + len(b.params)])
            i += len(b.params)
        eta_first, aimed_t, slope_t = aim_on_device(eta, gn, u, config.cap, config.rise, aim)
        try_eta, aimed, slope = float(eta_first), bool(aimed_t), float(slope_t)
        origin = [w.detach().clone() for w in weights]
        why = "cap" if aimed else "steps"
        for attempt in range(config.max_backoff + 1):
            with torch.no_grad():
                for w, w0, d in zip(weights, origin, u, strict=True):
                    w.copy_(w0 + try_eta * d)
            new_loss, new_grads = evaluate(model, loss_fn, x, y, params)
            verdict = step_verdict(float(new_loss), float(squared(new_grads)), loss0, config, gn)
            if verdict == "steps":
                break
            why = verdict
            backoffs += 1
            if attempt < config.max_backoff:
                try_eta *= shorten(why, float(squared(new_grads)), gn, config.cap, slope * try_eta)
        else:  # every try refused: back to W₀
            with torch.no_grad():
                for w, w0 in zip(weights, origin, strict=True):
                    w.copy_(w0)
            return why, steps, backoffs, (loss, gn)
        new_gn = float(squared(new_grads))
        if aimed:  # it landed: what it took teaches the model's next aim
            aim.learn(None, eta_first, try_eta, new_gn - gn, config.cap - gn)
        else:
            eta = try_eta
        steps, grads, loss, gn = steps + 1, new_grads, float(new_loss), new_gn
        if why == "cap":  # accepted once shortened under CAP, or aimed at it: CAP is reached
            return "cap", steps, backoffs, (loss, gn)
    return "steps", steps, backoffs, (loss, gn)


def second_backward(grads: list[Tensor], weights: list[Tensor]) -> list[Tensor]:
    """H·∇L for ``weights``: the backward of ∇L's graph against ∇L itself, (∂∇L/∂W)ᵀ ∇L = ∇(½‖∇L‖²)."""
    pairs = [(g, g.detach()) for g in grads if g.requires_grad]
    if not pairs:  # no second-order path at all (a linear model on MSE)
        return [torch.zeros_like(w) for w in weights]
    hvp = torch.autograd.grad([g for g, _ in pairs], weights, grad_outputs=[d for _, d in pairs], allow_unused=True)
    return [torch.zeros_like(w) if h is None else h for w, h in zip(weights, hvp, strict=True)]


def _classes(block: Block) -> list:
    if not block.classes:
        block.classes = partition(block)
    return block.classes
