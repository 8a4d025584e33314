"""π(H·∇L) of a weight used by F.linear alone, from its factors (exact τ = 1): no (out, in) H·∇L is formed.

At exact τ = 1 what π keeps of a Linear's teleport gradient is (b) = Σ_uses δᵀ C (``teleport.hvp.spanfree``):
δ (N, out) is the use's ∂L/∂Z, C (N, in) the second backward's adjoint of its ∂L/∂X = δ W. π acts on
the input side of each row of [W | b] (with R's basis K, (in + 1, k)), so

    π([δᵀC | 0]) = [δᵀ (C − (C K_in) K_inᵀ) | −δᵀ (C K_in) k_b]

and projecting the thin C (N × in × k) then multiplying once (out × N × in) replaces forming δᵀC (the
same product) and projecting it (two out × in × k products: ~1.7 ms of an MLP [1024, 1024] step of
~14 ms, 1 thread). Exactly the same operator, up to rounding. Single process only: across ranks the
whole batch's H·∇L is reduced before π (``teleport.distributed``), and factors are not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from teleport.geometry.blocks import Block, linear_only

if TYPE_CHECKING:
    from teleport.distributed import Collective
    from teleport.hvp.objective import Objective


def factored_direction(obj: Objective, blocks: list[Block], comm: Collective | None, gradient_and: Callable[..., Any],
                       project_blocks: Callable[..., list[Tensor]]) -> list[Tensor]:
    """π(H·∇L) for every block's params, in order: from factors where a block allows it, else projected."""
    only = linear_only(blocks)
    single = comm is None or comm.world_size == 1
    fac = [b for b in blocks if single and _factorable(b, obj, only)]
    keys = {id(b) for b in fac}
    rest = [b for b in blocks if id(b) not in keys]
    uses = [obj.factors[id(b.weight)] for b in fac]
    hvp, adjoints = gradient_and(obj, [p for b in rest for p in b.params], [c for u in uses for _, c in u], comm, only)
    projected = iter(project_blocks(rest, hvp, inplace=True))  # hvp is this step's own: projected where it lies
    it = iter(adjoints)
    from_factors = {id(b): _from_factors(b, [(d, next(it)) for d, _ in u]) for b, u in zip(fac, uses, strict=True)}
    out: list[Tensor] = []
    for b in blocks:
        out += from_factors[id(b)] if id(b) in from_factors else [next(projected) for _ in b.params]
    return out


def _factorable(b: Block, obj: Objective, only: dict[int, int | None]) -> bool:
    w = id(b.weight)
    whole_rows = len(b.classes) == 1 and b.classes[0].rows is None and b.classes[0].mask is None and b.bias_rows is None
    return w in only and w in obj.whole and bool(obj.factors.get(w)) and whole_rows and b.layout == "natural"


def _from_factors(b: Block, uses: list[tuple[Tensor, Tensor | None]]) -> list[Tensor]:
    """[π(∇W) | π(∇b)] of the block from its uses' (δ, C); a use whose C is unused adds nothing."""
    basis = b.classes[0].basis
    assert basis is not None
    vectors = basis.kept if basis.kept is not None else basis.free
    dtype = b.weight.dtype if vectors is None else vectors.dtype
    d = b.weight.shape[1]
    pairs = [(g.detach().to(dtype), c.reshape(-1, d).to(dtype)) for g, c in uses if c is not None]
    if not pairs:
        return [torch.zeros_like(p) for p in b.params]
    delta = torch.cat([g for g, _ in pairs]) if len(pairs) > 1 else pairs[0][0]  # (N, out)
    c = torch.cat([c for _, c in pairs]) if len(pairs) > 1 else pairs[0][1]  # (N, in)
    bias_col: Tensor | None = None  # (N,): δᵀ times it is π(∇b)
    if basis.free is not None:
        coords = c @ basis.free[:d]  # (N, f)
        c = coords @ basis.free[:d].T
        bias_col = coords @ basis.free[d] if b.bias is not None else None
    elif basis.kept is not None and basis.rank > 0:
        k = basis.kept
        coords = c @ k[:d]  # (N, k)
        bias_col = -(coords @ k[d]) if b.bias is not None else None
        c = torch.addmm(c, coords, k[:d].T, alpha=-1)
    out = [(delta.T @ c).to(b.weight.dtype)]
    if b.bias is not None:
        out.append(torch.zeros_like(b.bias) if bias_col is None else (delta.T @ bias_col).to(b.bias.dtype))
    return out
