"""The baseline: symmetry teleport (Zhao et al. 2022/2023) for MLPs with a bijective activation.

For each hidden layer m a group element g_m ∈ GL(d_m) acts on the pair of layers around it
(row layout: H is (n, d), H̃ = [H, 1] carries the bias):

    W̃_{m+1}[:, :d_m] ← W̃_{m+1}[:, :d_m] · g_m⁻¹
    W̃_mᵀ            ← W̃_mᵀ + pinv(H̃'_{m-1}) · (σ⁻¹( σ(Z_m) · g_mᵀ ) − H̃'_{m-1} W̃_mᵀ),   H̃' the transformed input

(the literature's pinv(H̃') · σ⁻¹(σ(Z_m) g_mᵀ) solved for the change of W̃_m: the same on the batch, the identity
at g = I; ``transformed_weights``)

so every hidden activation becomes h_m · g_mᵀ and the output is unchanged — exactly when
pinv(H̃') H̃' = I, i.e. when each transformed layer's augmented input (n, d+1) has full row rank
n: the teleport batch may not exceed any such layer's input width + 1. With a larger batch the
least-squares solve is only approximate and the loss moves (CAP and ``loss_tol`` then stop it).

g = I + εM, gradient ascent on M at M = 0 of ½‖∇_W L‖², as in the paper's Section 2.1. Each step
costs a pseudo-inverse per layer, O(d² n), and an inverse, O(d³).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from teleport.ascent.host import guarded_step
from teleport.config import TeleportConfig
from teleport.hvp.objective import LossFn, Objective, heldout_loss, objective
from teleport.modes import evaluating
from teleport.report import LayerReport, TeleportReport


def _mlp_layers(model: nn.Module) -> tuple[list[nn.Linear], float]:
    layers = getattr(model, "layers", None)
    slope = getattr(model, "negative_slope", None)
    if layers is None or not all(isinstance(m, nn.Linear) for m in layers) or not slope:
        raise ValueError(
            "symmetry teleport needs an MLP with `.layers` (nn.Linear list) and a LeakyReLU "
            "`.negative_slope`: set model.kind=mlp and model.activation=leaky_relu"
        )
    if any(m.bias is None for m in layers):
        raise ValueError("symmetry teleport expects Linear layers with bias: set model.bias=true")
    return list(layers), float(slope)


def _augmented(layer: nn.Linear) -> Tensor:
    return torch.cat([layer.weight, layer.bias.reshape(-1, 1)], dim=1)  # (d_out, d_in + 1)


@torch.no_grad()
def _write(layers: list[nn.Linear], weights: list[Tensor]) -> None:
    for module, w in zip(layers, weights, strict=True):
        module.weight.copy_(w[:, :-1])
        module.bias.copy_(w[:, -1])


def _ones_col(h: Tensor) -> Tensor:
    return torch.cat([h, h.new_ones(h.shape[0], 1)], dim=1)  # (n, d) -> (n, d + 1)


def _inv_leaky(z: Tensor, slope: float) -> Tensor:
    return torch.where(z > 0, z, z / slope)


def _forward(weights: list[Tensor], x: Tensor, slope: float) -> Tensor:
    h = x.flatten(1)
    for i, w in enumerate(weights):
        h = _ones_col(h) @ w.T
        if i < len(weights) - 1:
            h = F.leaky_relu(h, slope)
    return h


def transformed_weights(weights: list[Tensor], gs: list[Tensor], x: Tensor, slope: float) -> list[Tensor]:
    """Apply g_1 .. g_{L-1} (one per hidden layer) to augmented weights [W | b], all at once.

    Layer m must map its transformed input H' to σ⁻¹(σ(Z_m) g_mᵀ); the literature solves for the weights,
    W' = (H'⁺ target)ᵀ, which keeps W only where the batch's inputs span: at g = I that is W projected onto them, a
    different model whenever the batch is narrower than the layer (backpropagation through the dropped part
    changes every earlier layer's gradient: ‖∇L‖² 9 % lower in a test's MLP at the same loss). Here it solves for
    the change, W' = W + (H'⁺ (target − H' Wᵀ))ᵀ: the same outputs on the batch (the same least-squares residual),
    W' = W exactly at g = I, and no change of W where the batch does not reach."""
    out: list[Tensor] = []
    h_in = x.flatten(1)  # H'_{m-1}: the transformed input of layer m, (n, d)
    h = x.flatten(1)  # the original activations
    for m, w in enumerate(weights[:-1]):
        z = _ones_col(h) @ w.T  # (n, d_m)
        h = F.leaky_relu(z, slope)
        target = _inv_leaky(h @ gs[m].T, slope)  # σ⁻¹(σ(Z_m) g_mᵀ)
        inputs = _ones_col(h_in)
        out.append(w + (torch.linalg.pinv(inputs) @ (target - inputs @ w.T)).T)
        h_in = h @ gs[m].T
    last = weights[-1]
    out.append(torch.cat([last[:, :-1] @ torch.linalg.inv(gs[-1]), last[:, -1:]], dim=1))
    return out


def _rising_eta(rise: float, lr: float, grad_norm_sq: float, rate: float) -> float:
    """``TeleportConfig.rise``'s η (``lr`` where the rate is 0) for a step along the group's ascent dM, from ‖∇L‖²
    where the step starts (g = I: the model as it is) and its rate d‖∇L‖²/dη = 2‖dM‖²."""
    return rise * grad_norm_sq / rate if 0 < rate < math.inf else lr


def symmetry_teleport_batch(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    config: TeleportConfig | None = None,
    holdout: tuple[Tensor, Tensor] | None = None,
) -> TeleportReport:
    """Symmetry teleport of an MLP in place on one batch; same CAP/back-off rules as the null-space one."""
    config = config or TeleportConfig()
    start = time.perf_counter()
    layers, slope = _mlp_layers(model)
    with evaluating(model):
        heldout_before = heldout_loss(model, loss_fn, holdout)
        params = [p for p in model.parameters() if p.requires_grad]

        def evaluate() -> Objective:
            return objective(model, loss_fn, x, y, params)

        cur = evaluate()
        loss0, gn0 = cur.loss, cur.grad_norm_sq
        config = config.for_batch(gn0)  # this batch's CAP (``cap_ratio``)
        steps = backoffs = 0
        reason, eta = "steps", config.lr
        while steps < config.steps:
            if cur.grad_norm_sq >= config.cap:
                reason = "cap"
                break
            base = [_augmented(m).detach() for m in layers]
            ms = [torch.zeros(m.out_features, m.out_features, dtype=x.dtype, device=x.device,
                              requires_grad=True) for m in layers[:-1]]
            eye = [torch.eye(m.shape[0], dtype=x.dtype, device=x.device) for m in ms]
            new_w = transformed_weights(base, [i + m for i, m in zip(eye, ms, strict=True)], x, slope)
            loss = loss_fn(_forward(new_w, x, slope), y)
            grads = torch.autograd.grad(loss, new_w, create_graph=True)
            half = 0.5 * sum((g * g).sum() for g in grads)
            dms = torch.autograd.grad(half, ms)
            if config.rise is not None:  # d‖∇L‖²/dη along the group's ascent is 2‖dM‖²: η for a rise of that share
                rate = 2.0 * float(sum((d.double() ** 2).sum() for d in dms))
                eta = _rising_eta(config.rise, config.lr, cur.grad_norm_sq, rate)

            def move(step: float, base: list[Tensor] = base, dms: tuple[Tensor, ...] = dms,
                     eye: list[Tensor] = eye) -> None:
                with torch.no_grad():
                    gs = [i + step * d for i, d in zip(eye, dms, strict=True)]
                    _write(layers, transformed_weights(base, gs, x, slope))

            # no ‖∇L‖² before the step: its path through the group is not smooth (a step of η 1e-3 on a digits-size
            # MLP can lower ‖∇L‖² however short it is made), so it is not held to an ascent, and an overshoot of CAP
            # is halved (``rules.shorten``)
            new, eta, tries, why = guarded_step(move, lambda b=base: _write(layers, b), evaluate, loss0, eta, config)
            backoffs += tries
            if new is None:
                cur, reason = evaluate(), why
                break
            cur, steps = new, steps + 1
            if why == "cap":  # shortened to fit under CAP: CAP is reached (the null-space teleport's rule)
                reason = "cap"
                break
        n = x.shape[0]
        reports = [LayerReport(f"layers.{i}", "symmetry", m.in_features + 1, min(n, m.in_features + 1),
                               max(0, m.in_features + 1 - n), 1.0) for i, m in enumerate(layers[:-1])]
        heldout_after = heldout_loss(model, loss_fn, holdout)
        return TeleportReport(
            loss_before=loss0,
            loss_after=cur.loss,
            grad_norm_sq_before=gn0,
            grad_norm_sq_after=cur.grad_norm_sq,
            steps=steps,
            backoffs=backoffs,
            stop_reason=reason,
            seconds=time.perf_counter() - start,
            method="symmetry",
            layers=reports,
            heldout_loss_before=heldout_before,
            heldout_loss_after=heldout_after,
        )
