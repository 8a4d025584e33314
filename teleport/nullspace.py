"""Step 3: teleport by gradient ascent on ½‖∇L‖², projected onto each layer's input null space.

eq. 5:   W_l ← W_l + η · π_l(∇_{W_l} L_teleport),   L_teleport = ½ ‖∇_W L‖²

(the paper's pseudo-code writes "−"; the text and the goal — a larger gradient norm at equal
loss — are ascent). ∇_W L_teleport = H·∇L is one double backward: a ``create_graph=True``
gradient, then the gradient of its squared norm. Because π_l(U)·R_l = 0, every layer's output
on the teleport batch is unchanged, so the batch loss is too (exactly at τ = 1, within a bounded
drift at τ < 1), while the downstream weights that shape the backward pass have moved.

CAP (Algorithm 1): no step is taken once ‖∇L‖² ≥ CAP. A step that would overshoot CAP or raise
the batch loss by more than ``loss_tol`` (relative) is backed off by halving η.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from teleport.bases import Basis, BasisExecutor, SerialExecutor, compute_basis, project
from teleport.capture import LayerInputs, capture_inputs, untouched_parameters
from teleport.report import LayerReport, TeleportConfig, TeleportReport

LossFn = Callable[[Tensor, Tensor], Tensor]


def scalar(t: Tensor) -> float:
    return float(t.detach())


@dataclass
class Objective:
    """L and ‖∇L‖² at the current weights, with the graph kept for the double backward."""

    loss: Tensor
    grad_norm_sq: Tensor


def objective(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, params: list[Tensor]) -> Objective:
    """L(W) and ‖∇_W L‖² over every trainable parameter (create_graph=True, for H·∇L).

    Fused attention kernels (flash, memory-efficient) have no double backward: the math kernel
    of scaled_dot_product_attention is forced here.
    """
    with sdpa_kernel(SDPBackend.MATH):
        loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    gn2 = sum(((g * g).sum() for g in grads if g is not None), loss.new_zeros(()))
    return Objective(loss, gn2)


def teleport_gradient(obj: Objective, weights: list[Tensor]) -> list[Tensor]:
    """∇_W ½‖∇L‖² = H·∇L for the given weights (the second backward)."""
    if not obj.grad_norm_sq.requires_grad:  # no second-order path at all (e.g. a linear model on MSE)
        return [torch.zeros_like(w) for w in weights]
    grads = torch.autograd.grad(0.5 * obj.grad_norm_sq, weights, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for w, g in zip(weights, grads, strict=True)]


@dataclass
class _Layer:
    """A captured layer, its parameters and one basis per group."""

    inputs: LayerInputs
    bases: list[Basis]

    @property
    def params(self) -> list[Tensor]:
        m = self.inputs.module
        return [m.weight] if m.bias is None else [m.weight, m.bias]

    def projected(self, grads: list[Tensor]) -> list[Tensor]:
        """π applied to [∇W | ∇b] group by group, returned in the parameters' own shapes."""
        gw = grads[0].reshape(grads[0].shape[0], -1)  # (C_o, d)
        g = gw if len(grads) == 1 else torch.cat([gw, grads[1].reshape(-1, 1)], dim=1)
        rows = g.shape[0] // len(self.bases)
        u = torch.cat([project(g[i * rows : (i + 1) * rows], b) for i, b in enumerate(self.bases)])
        out = [u[:, : gw.shape[1]].reshape(grads[0].shape)]
        if len(grads) == 2:
            out.append(u[:, -1].reshape(grads[1].shape))
        return out

    def reports(self) -> list[LayerReport]:
        e = self.inputs
        return [
            LayerReport(
                e.name if len(self.bases) == 1 else f"{e.name}[group {i}]",
                e.kind, b.dim, b.rank, b.free_dims, b.captured_variance,
            )
            for i, b in enumerate(self.bases)
        ]


def layer_bases(
    captured: dict[str, LayerInputs], tau: float, executor: BasisExecutor
) -> list[_Layer]:
    """One basis per distinct representation (Q/K/V share theirs), computed through ``executor``."""
    reps: list[Tensor] = []
    index: dict[int, int] = {}
    slots: list[list[int]] = []
    for entry in captured.values():
        ids = []
        for g in range(entry.groups):
            rep = entry.representation(g)
            if id(rep) not in index:
                index[id(rep)] = len(reps)
                reps.append(rep)
            ids.append(index[id(rep)])
        slots.append(ids)
    bases = executor.map(lambda r: compute_basis(r, tau), reps)
    return [_Layer(e, [bases[i] for i in ids]) for e, ids in zip(captured.values(), slots, strict=True)]


def _heldout_loss(model: nn.Module, loss_fn: LossFn, holdout: tuple[Tensor, Tensor] | None) -> float | None:
    if holdout is None:
        return None
    with torch.no_grad():
        return scalar(loss_fn(model(holdout[0]), holdout[1]))


def teleport_batch(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    config: TeleportConfig | None = None,
    executor: BasisExecutor | None = None,
    holdout: tuple[Tensor, Tensor] | None = None,
) -> TeleportReport:
    """Teleport ``model`` in place on one batch (Algorithm 1's inner loops for one of the b batches).

    Runs in eval mode (dropout off, BatchNorm on its running statistics, which are never changed)
    and restores the model's mode afterwards. ``holdout`` adds the loss on held-out data before
    and after, which — unlike the batch loss — is free to drift.
    """
    config = config or TeleportConfig()
    executor = executor or SerialExecutor()
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        heldout_before = _heldout_loss(model, loss_fn, holdout)
        with capture_inputs(model) as captured:  # step 1: R per layer, from the same forward as L
            cur = objective(model, loss_fn, x, y, params)
        layers = layer_bases(captured, config.tau, executor)  # step 2
        for layer in layers:  # the bases are all that is needed of R from here on
            layer.inputs.chunks = []
        loss0, gn0 = scalar(cur.loss), scalar(cur.grad_norm_sq)
        weights = [p for layer in layers for p in layer.params]
        steps = backoffs = 0
        reason = "steps"
        eta = config.lr
        if not any(b.free_dims for layer in layers for b in layer.bases):
            reason = "no_free_directions"
        while reason == "steps" and steps < config.steps:  # step 3: t projected ascent steps
            if scalar(cur.grad_norm_sq) >= config.cap:
                reason = "cap"
                break
            grads = teleport_gradient(cur, weights)
            direction: list[Tensor] = []
            i = 0
            for layer in layers:
                n = len(layer.params)
                direction += layer.projected(grads[i : i + n])
                i += n
            origin = [w.detach().clone() for w in weights]
            for attempt in range(config.max_backoff + 1):
                with torch.no_grad():
                    for w, w0, u in zip(weights, origin, direction, strict=True):
                        w.copy_(w0 + eta * u)
                new = objective(model, loss_fn, x, y, params)
                over_cap = scalar(new.grad_norm_sq) > config.cap
                loss_up = scalar(new.loss) - loss0 > config.loss_tol * max(abs(loss0), 1e-12)
                if not (over_cap or loss_up):
                    cur = new
                    steps += 1
                    break
                backoffs += 1
                if attempt == config.max_backoff:  # give the step up: back to where it started
                    with torch.no_grad():
                        for w, w0 in zip(weights, origin, strict=True):
                            w.copy_(w0)
                    reason = "cap" if over_cap else "loss_tol"
                    break
                eta /= 2
        return TeleportReport(
            loss_before=loss0,
            loss_after=scalar(cur.loss),
            grad_norm_sq_before=gn0,
            grad_norm_sq_after=scalar(cur.grad_norm_sq),
            steps=steps,
            backoffs=backoffs,
            stop_reason=reason,
            seconds=time.perf_counter() - start,
            layers=[r for layer in layers for r in layer.reports()],
            untouched=untouched_parameters(model, {layer.inputs.name: layer.inputs for layer in layers}),
            heldout_loss_before=heldout_before,
            heldout_loss_after=_heldout_loss(model, loss_fn, holdout),
        )
    finally:
        model.train(was_training)
