"""H·∇L without a double backward: a forward difference of two gradients (``teleport.hvp: difference``).

The exact teleport gradient ∇(½‖∇L‖²) = H·∇L is one backward of ∇L's own graph (``teleport.objective``): the
gradient's graph is kept (``create_graph``) and differentiated again. Along v = ∇L,

    H·v ≈ (∇L(W + εv) − ∇L(W)) / ε

needs only ∇L at a shifted point: one more plain forward + backward, no graph kept, no second-order pass. The
evaluation at W (which the guard needs for L and ‖∇L‖² anyway) gives ∇L(W); every parameter is shifted, not only
the moving ones (H·v's rows for the moving weights read all of v). The direction is then projected as the exact
one is, so the loss on the teleport batch is unchanged exactly as before — π, not the HVP, keeps it — and the
guard still accepts only steps that raise ‖∇L‖².

ε: the shift's norm ε‖v‖ is ``REL`` · √u · (1 + ‖W‖) (u: the weights' machine epsilon; float32 and float64 only).
Truncation error grows with ε, rounding with 1/ε; the usual √u(1 + ‖W‖) (``REL`` = 1) was truncation-bound on the
GPT-style LM (d = 128, float32: cosine 0.9979 to the float64 direction; 0.99998 at 0.1, 0.999997 at 0.03) and on
the test families (a teleport's move 2e-2 off the exact one at 1, 3e-4 to 2e-3 at 0.03-0.1; float64: 2e-8 to 8e-8).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from teleport.objective import Objective

REL = 0.05  # ε‖v‖ = REL·√u·(1 + ‖W‖)
Shifted = Callable[[list[Tensor], Tensor], list[Tensor]]  # (v, ε) -> ∇L at W + ε·v, every parameter, whole batch
DTYPES = (torch.float32, torch.float64)


def check_dtypes(params: list[Tensor]) -> None:
    """A difference of gradients needs float32 or float64 weights (bf16's √u is 0.09: no digit would be left)."""
    odd = sorted({str(p.dtype).removeprefix("torch.") for p in params if p.dtype not in DTYPES})
    if odd:
        raise ValueError(f"teleport.hvp 'difference' needs float32 or float64 weights, the model has {', '.join(odd)}: "
                         "use teleport.hvp 'exact'")


def difference_hvp(obj: Objective, params: list[Tensor], weights: list[Tensor], shifted: Shifted) -> list[Tensor]:
    """H·∇L for ``weights`` (a subset of ``params``) from ∇L at W and at W + ε∇L. No host read (ε, ‖∇L‖² and ‖W‖
    stay on the device), so the device ticks and a CUDA graph can hold it (``teleport.on_device``); the arithmetic
    is a few multi-tensor (``_foreach``) kernels, not one per parameter."""
    grads = obj.global_grads
    assert obj.scalars is not None, "an objective from objective_tensors carries its [‖∇L‖², L]"
    u = torch.finfo(params[0].dtype).eps
    with torch.no_grad():
        w_norm = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float64)).norm()
        eps = REL * math.sqrt(u) * (1 + w_norm) / obj.scalars[0].clamp_min(1e-300).sqrt()
    moved = shifted(grads, eps)
    index = {id(p): i for i, p in enumerate(params)}
    rows = [index[id(w)] for w in weights]
    with torch.no_grad():
        out = torch._foreach_sub([moved[i] for i in rows], [grads[i] for i in rows])
        torch._foreach_mul_(out, (1 / eps).to(weights[0].dtype))
    return list(out)


def shift_params(params: list[Tensor], along: list[Tensor], eps: Tensor) -> list[Tensor]:
    """Move every parameter to W + ε·v in a storage of its own; returns the storages to put back (``unshift``).
    The new storages come from the allocator: inside a CUDA graph, from the graph's pool, at fixed addresses."""
    saved = [p.data for p in params]
    with torch.no_grad():
        moved = torch._foreach_add(saved, torch._foreach_mul(along, eps.to(params[0].dtype)))
    for p, m in zip(params, moved, strict=True):
        p.data = m
    return saved


def unshift(params: list[Tensor], saved: list[Tensor]) -> None:
    """Every parameter back in the storage it had: W exactly, not W + εv − εv."""
    for p, s in zip(params, saved, strict=True):
        p.data = s
