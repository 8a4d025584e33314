"""H·∇L without a double backward: a forward difference of two gradients (``teleport.hvp: difference``).

The exact teleport gradient ∇(½‖∇L‖²) = H·∇L is one backward of ∇L's own graph (``teleport.hvp.objective``): the
gradient's graph is kept (``create_graph``) and differentiated again. Along v = ∇L,

    H·v ≈ (∇L(W + εv) − ∇L(W)) / ε

needs only ∇L at a shifted point: one more plain forward + backward, no graph kept, no second-order pass. The
evaluation at W (which the guard needs for L and ‖∇L‖² anyway) gives ∇L(W); every parameter is shifted, not only
the moving ones (H·v's rows for the moving weights read all of v). The direction is then projected as the exact
one is, so the loss on the teleport batch is unchanged exactly as before — π, not the HVP, keeps it — and the
guard still accepts only steps that raise ‖∇L‖².

ε: the shift's norm ε‖v‖ is ``REL`` · s · √u · (1 + ‖W‖) (u: the weights' machine epsilon; float32 and float64 only),
s ≤ 1 a factor the model learns (``ShiftScale``, its ``Teleporter``'s). Truncation error grows with ε, rounding with
1/ε; the usual √u(1 + ‖W‖) (``REL`` = 1) was truncation-bound on the GPT-style LM (d = 128, float32: cosine 0.9979 to
the float64 direction; 0.99998 at 0.1, 0.999997 at 0.03) and on the test families (a teleport's move 2e-2 off the
exact one at 1, 3e-4 to 2e-3 at 0.03-0.1; float64: 2e-8 to 8e-8). No fixed ε holds as a model sharpens, though: once
teleports have raised the GPT-style LM's ‖∇L‖² ~5,000x the shift is far too long (d 128, float32: cosine 0.67 to the
exact direction; on an H200 −0.05 after a benchmark's teleports). The sign is δ = ‖∇L(W + εv) − ∇L(W)‖ / ‖∇L(W)‖ over
the moving weights, the gradient's relative change along the shift: 1e-3 on the fresh LM and ≤ 4e-3 on the test
families (cosine 0.999998), 0.15 and 3.8 on the sharpened LM (0.995, 0.67); a shift cut to δ 4e-2 gave 0.99995 there.
Each difference measures its δ and, where it passes ``DELTA`` (30√u: 1e-2 in float32), shortens the next shift to land
there (s back towards 1 as δ falls); the factor persists with the model's ``Teleporter`` (and its checkpoint), so a
later teleport's first step starts from it. A model whose δ stays under ``DELTA`` keeps s = 1: the shifts above, bit
for bit. All on the device, no host read.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from teleport.hvp.objective import Objective

REL = 0.05  # ε‖v‖ = REL·s·√u·(1 + ‖W‖), s = ``ShiftScale``'s factor
DELTA = 30.0  # the gradient's largest relative change δ along a shift, in √u (float32: 1.0e-2)
SCALE = (1e-3, 1.0)  # s's range; one difference may set it anywhere in it
Shifted = Callable[[list[Tensor], Tensor], list[Tensor]]  # (v, ε) -> ∇L at W + ε·v, every parameter, whole batch
DTYPES = (torch.float32, torch.float64)


def check_dtypes(params: list[Tensor]) -> None:
    """A difference of gradients needs float32 or float64 weights (bf16's √u is 0.09: no digit would be left)."""
    odd = sorted({str(p.dtype).removeprefix("torch.") for p in params if p.dtype not in DTYPES})
    if odd:
        raise ValueError(f"teleport.hvp 'difference' needs float32 or float64 weights, the model has {', '.join(odd)}: "
                         "use teleport.hvp 'exact'")


class ShiftScale:
    """A model's factor s on ε: ``now`` (a 0-d float64) is what a difference reads, ``proposed`` what its δ asks of the
    next; ``commit`` keeps the proposal where the difference's direction was used (the device ticks compute one every
    tick and use it only to start a step, the host guard only to start one: so both learn from the same
    differences). Updated in place: a CUDA graph that captured them reads and writes the same tensors at every
    replay."""

    def __init__(self, device: torch.device) -> None:
        self.now = torch.ones((), dtype=torch.float64, device=device)
        self.proposed = self.now.clone()

    def state_dict(self) -> dict[str, float]:
        return {"now": float(self.now), "proposed": float(self.proposed)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        with torch.no_grad():
            self.now.fill_(state["now"])
            self.proposed.fill_(state["proposed"])

    def commit(self, used: Tensor | None = None) -> None:
        """Keep the proposed s (where ``used``, a 0-d bool, is true; None: always)."""
        with torch.no_grad():
            self.now.copy_(self.proposed if used is None else torch.where(used, self.proposed, self.now))


def difference_hvp(obj: Objective, params: list[Tensor], weights: list[Tensor], shifted: Shifted,
                   scale: ShiftScale | None = None) -> list[Tensor]:
    """H·∇L for ``weights`` (a subset of ``params``) from ∇L at W and at W + ε∇L, ε from ``scale`` (``ShiftScale``:
    its s now; the next difference's s proposed from this one's δ; None: a factor of 1, not learned). No host read
    (ε, ‖∇L‖², ‖W‖ and δ stay on the device), so the device ticks and a CUDA graph can hold it
    (``teleport.ascent.device``); the arithmetic is a few multi-tensor (``_foreach``) kernels, not one per parameter."""
    grads = obj.global_grads
    assert obj.scalars is not None, "an objective from objective_tensors carries its [‖∇L‖², L]"
    root_u = math.sqrt(torch.finfo(params[0].dtype).eps)
    with torch.no_grad():
        w_norm = _norm(params)
        eps = REL * root_u * (1 + w_norm) / obj.scalars[0].clamp_min(1e-300).sqrt()
        if scale is not None:
            eps = eps * scale.now
    moved = shifted(grads, eps)
    index = {id(p): i for i, p in enumerate(params)}
    rows = [index[id(w)] for w in weights]
    with torch.no_grad():
        out = torch._foreach_sub([moved[i] for i in rows], [grads[i] for i in rows])
        if scale is not None:  # δ of this shift proposes the next one's s
            delta = _norm(out) / _norm([grads[i] for i in rows]).clamp_min(1e-300)
            aim = torch.where(delta.isfinite(), DELTA * root_u / delta.clamp_min(1e-300), 0.0)
            scale.proposed.copy_((scale.now * aim).clamp(*SCALE))
        torch._foreach_mul_(out, (1 / eps).to(weights[0].dtype))
    return list(out)


def _norm(tensors: list[Tensor]) -> Tensor:
    """‖tensors‖ read as one vector, a 0-d float64."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).norm()


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
