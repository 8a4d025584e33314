"""H·∇L without the part that π removes anyway: a Linear's weight gradient through its own outputs.

A weight W of a linear map Z = W X (+ b) appears twice in ½‖∇L‖²: in the forward (Z) and in the
backward (∂L/∂X = Wᵀ δ). Its teleport gradient is accordingly the sum of

    (a) (∂F/∂Z) Xᵀ   — through Z: every row lies in the span of the inputs X (with the bias' ones row),
    (b) δ Cᵀ         — through the backward's Wᵀ δ, C being ∂F/∂(∂L/∂X),

and at τ = 1 (the numerical rank) π removes the span of X, so π(H·∇L) = π((b)): (a) is computed only
to be projected away (up to directions below the rank tolerance, which X barely reaches). While
``SpanFreeLinear`` is on, ``F.linear`` runs as ``_Linear``: the same forward kernel, and a backward
that — when it builds ∇L's graph (grad mode on, ``create_graph``) — returns ∂L/∂W and ∂L/∂b as usual,
but — when it runs inside the H·∇L backward (grad mode off) — returns only ∂/∂X. So the second
backward skips the matrix product of (a), one of the six products a Linear costs there.

The H·∇L it gives differs from the true one by (a), which π removes: use it only with exact τ = 1.
π of it is also more accurate: (a) is most of H·∇L, so projecting it away cancels most digits
(float32, MLP [1024, 1024]: the two agree to ~1e-5 relative; float64 to ~1e-12).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

_linear = torch._C._nn.linear


class _Linear(torch.autograd.Function):
    """y = x Wᵀ + b whose backward leaves out ∂/∂W, ∂/∂b when it runs outside grad mode (the H·∇L pass)."""

    @staticmethod
    def forward(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return _linear(x, w, b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x, w, b = inputs
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = gb = None
        if torch.is_grad_enabled():  # building ∇L with its graph: the weight's gradient, as F.linear's
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[1]:
                gw = g2.T @ x.reshape(-1, x.shape[-1])
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = g2.sum(0)
        return gx, gw, gb


def _applies(x: Any, w: Any, b: Any) -> bool:
    """A plain float Linear on a trainable 2-D weight, same dtype throughout, no autocast."""
    if not (isinstance(x, Tensor) and isinstance(w, Tensor) and w.requires_grad and w.dim() == 2 and x.dim() >= 1):
        return False
    if b is not None and not (isinstance(b, Tensor) and b.dtype == w.dtype):
        return False
    return x.dtype == w.dtype and not torch.is_autocast_enabled(x.device.type)


class SpanFreeLinear(TorchFunctionMode):
    """While on, ``F.linear`` (nn.Linear, attention projections, raw calls) runs as ``_Linear``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            call = dict(zip(("input", "weight", "bias"), args, strict=False), **kwargs)
            x, w, b = call.get("input"), call.get("weight"), call.get("bias")
            if _applies(x, w, b):
                return _Linear.apply(x, w, b)
        return func(*args, **kwargs)
