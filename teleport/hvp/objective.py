"""The teleport objective L_teleport = ½‖∇L‖² and its gradient, for one batch or its shards across ranks.

∇_W L_teleport = H·∇L is one double backward: a ``create_graph=True`` gradient of the batch loss,
then the backward of that gradient graph against ∇L itself. Across data-parallel ranks each rank
holds w_r·∇L_r with its graph; the gradients (and L) are all-reduced into the whole batch's, and each
rank's second backward against the *global* ∇L, summed, is the whole batch's H·∇L
(``teleport.distributed``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from teleport.distributed import Collective, all_reduce_list_
from teleport.geometry.capture import UseRecorder
from teleport.hvp.spanfree import SpanFreeLinear, backward_inputs, sum_or_zero

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class Objective:
    """L and ‖∇L‖² of the whole teleport batch, and this rank's gradient graph for the HVP.

    ``local_grads`` are w_r·∇L_r with their graph (create_graph=True); ``global_grads`` are the
    detached ∇L of the whole batch (the sum of every rank's w_r·∇L_r; the same tensors' values
    in a single process).
    """

    loss: float
    grad_norm_sq: float
    local_grads: list[Tensor]
    global_grads: list[Tensor]
    aliases: dict[int, Tensor] = field(default_factory=dict)  # id(W) -> W's backward alias (``teleport.hvp.spanfree``)
    whole: set[int] = field(default_factory=set)  # the weights whose F.linear uses all went through their alias
    factors: dict[int, list[tuple[Tensor, Tensor]]] = field(default_factory=dict)  # id(W) -> its uses' (δ, ∂L/∂X)
    fetched: list[float] = field(default_factory=list)  # the ``fetch`` scalars, read in the same host sync
    scalars: Tensor | None = None  # [‖∇L‖², L] on the weights' device, float64: what ``loss``/``grad_norm_sq`` read


def objective(*args: Any, fetch: tuple[Tensor, ...] = (), reads: HostReads | None = None, **kwargs: Any) -> Objective:
    """L(W) and ‖∇_W L‖² over every trainable parameter, keeping the graph for H·∇L (unless ``graph`` is False).

    ``objective_tensors`` (its arguments), read: L, ‖∇L‖² and the scalars of ``fetch`` (e.g. the η a step
    took, decided on the device) reach the host in one copy, the only host sync of an evaluation
    (``reads`` counts them).
    """
    obj, scalars = objective_tensors(*args, **kwargs)
    gn2, loss_value, *fetched = host_floats(torch.cat([scalars] + [t.reshape(1).double() for t in fetch]), reads)
    return replace(obj, loss=loss_value, grad_norm_sq=gn2, fetched=fetched)


def objective_tensors(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    params: list[Tensor],
    comm: Collective | None = None,
    share: float = 1.0,
    recorder: UseRecorder | None = None,
    graph: bool = True,
    span_free: bool = False,
) -> tuple[Objective, Tensor]:
    """The objective on the device, nothing read: (its gradients with their graph, L and ‖∇L‖² still NaN;
    [‖∇L‖², L] as a float64 tensor on the weights' device). No host sync (single process), so a CUDA graph
    can capture it (``teleport.ascent.device``).

    ``share`` is this rank's weight n_r / N in the whole batch's mean loss. Fused attention
    kernels (flash, memory-efficient) have no double backward: the math kernel of
    scaled_dot_product_attention is forced here. With a ``recorder``, the forward (and the loss, which
    may use parameters too) runs under it: every use of a parameter is recorded. With ``span_free``
    (exact τ = 1 only) the graph leaves out what π removes from H·∇L (``teleport.hvp.spanfree``).
    """
    fast = SpanFreeLinear() if span_free and graph else None
    local, global_grads, loss_sum = _gradients(model, loss_fn, x, y, params, comm, share, recorder, graph, fast)
    scalars = torch.stack([squared_norm(global_grads).to(loss_sum.device), loss_sum[0].double()])
    nan = math.nan
    if fast is None:
        return Objective(nan, nan, local, global_grads, scalars=scalars), scalars
    return Objective(nan, nan, local, global_grads, fast.aliases, fast.whole(), fast.factors, scalars=scalars), scalars


def recorded_loss(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, recorder: UseRecorder,
                  reads: HostReads | None = None) -> Objective:
    """L alone (read on the host: one sync), from a forward under ``recorder``: every use recorded as ``objective``
    records it (autograd on, so an input that depends on no weight is told apart; the graph dropped, no backward).
    ‖∇L‖² is NaN, no gradient computed: the start of a batch whose first tick, replayed from a CUDA graph, evaluates
    L and ∇L itself (``teleport.teleporter``). Single process."""
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH), recorder:
        loss = loss_fn(model(x), y).detach()
    (value,) = host_floats(loss.reshape(1).double(), reads)
    return Objective(value, math.nan, [], [])


def gradients(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, params: list[Tensor],
              comm: Collective | None = None, share: float = 1.0) -> list[Tensor]:
    """∇L of the whole batch, detached, no graph kept, nothing else computed (no ‖∇L‖²): the second gradient of
    ``teleport.hvp.difference``."""
    return _gradients(model, loss_fn, x, y, params, comm, share, None, False, None)[1]


def _gradients(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, params: list[Tensor],
               comm: Collective | None, share: float, recorder: UseRecorder | None, graph: bool,
               fast: SpanFreeLinear | None) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """(this rank's w_r·∇L_r with its graph, the whole batch's ∇L detached, the whole batch's L as a 1-element
    tensor): ``objective_tensors`` without the norm."""
    with sdpa_kernel(SDPBackend.MATH), fast or nullcontext(), recorder or nullcontext():
        loss = loss_fn(model(x), y) * share
    grads = torch.autograd.grad(loss, params, create_graph=graph, allow_unused=True)
    local = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    total = [g.detach() for g in local] + [loss.detach().reshape(1)]
    if comm is not None and comm.world_size > 1:
        total = [t.clone() for t in total]  # reduced in place: never into the graph's own tensors
        all_reduce_list_(comm, total)  # ∇L = Σ_r w_r ∇L_r, L = Σ_r w_r L_r: one collective
    return local, total[:-1], total[-1]


class HostReads:
    """How many times a teleporter read device values on the host (``host_floats``): each a sync on a GPU."""

    def __init__(self) -> None:
        self.count = 0


def host_floats(t: Tensor, reads: HostReads | None = None) -> list[float]:
    """A 1-d tensor's values on the host: one device-to-host copy (a sync on a GPU), counted in ``reads``."""
    if reads is not None:
        reads.count += 1
    return t.tolist()


def heldout_loss(model: nn.Module, loss_fn: LossFn, holdout: tuple[Tensor, Tensor] | None) -> float | None:
    """The loss on held-out data (free to drift, unlike the batch loss), or None without any."""
    if holdout is None:
        return None
    with torch.no_grad():
        return float(loss_fn(model(holdout[0]), holdout[1]).detach())


def squared_norm(tensors: list[Tensor]) -> Tensor:
    """Σ ‖g‖², a float64 scalar: each g·g a BLAS dot in g's precision (float32 at least), summed in float64.

    Not ``vector_norm(g, dtype=float64)``: that copies every gradient to float64 first (3 ms of a
    [1024, 1024] MLP's 32 ms step, 1 thread); nor a float32 ``vector_norm``, 2e-5 off on 1M elements
    (measured). The float32 dot is within 3e-6 of the float64 sum (2.6e-6 on 1M elements). On CUDA a dot is
    a kernel launch a tensor (~40 for a 4-block transformer, up to three times a step): there one multi-tensor
    ``_foreach_norm`` with a float64 result does them all (``tests/teleport/test_cuda.py`` checks it against
    the float64 sum). On the CPU that route is 6x slower than the dots (0.97 vs 0.17 ms, an MLP's gradients).
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    flat = [g.reshape(-1).float() if g.dtype in (torch.float16, torch.bfloat16) else g.reshape(-1) for g in tensors]
    if flat[0].device.type == "cuda":
        return torch.stack(torch._foreach_norm(flat, 2, dtype=torch.float64)).square().sum()
    return torch.stack([torch.dot(g, g) for g in flat]).double().sum()


def teleport_gradient(obj: Objective, weights: list[Tensor], params: list[Tensor],
                      comm: Collective | None = None, linear_only: dict[int, int | None] | None = None) -> list[Tensor]:
    """∇_W ½‖∇L‖² = H·∇L for ``weights`` (a subset of ``params``): the second backward.

    The backward of this rank's gradient graph against the global gradient gives w_r H_r·∇L;
    summed over ranks it is the whole batch's H·∇L. ``linear_only`` (id(W) -> id(its bias), from
    ``blocks.linear_only``, exact τ = 1 only) names the weights used by F.linear alone: with a backward
    alias in ``obj``, their H·∇L is taken through the alias, their bias' is 0 (``teleport.hvp.spanfree``).
    """
    return teleport_gradient_and(obj, weights, [], comm, linear_only)[0]


def teleport_gradient_and(obj: Objective, weights: list[Tensor], extra: list[Tensor], comm: Collective | None = None,
                          linear_only: dict[int, int | None] | None = None) -> tuple[list[Tensor], list[Tensor | None]]:
    """``teleport_gradient``, and from the same second backward the gradients of ½‖∇L‖² by ``extra``
    (tensors of ∇L's graph; None where unused; this rank's, never reduced)."""
    inputs = backward_inputs(obj.aliases, obj.whole, weights, linear_only or {})
    flat = [t for ts in inputs for t in ts] + extra
    pairs = [(lg, gg) for lg, gg in zip(obj.local_grads, obj.global_grads, strict=True) if lg.requires_grad]
    grads: tuple[Tensor | None, ...] = (None,) * len(flat)
    if pairs and flat:  # no pair: no second-order path at all (e.g. a linear model on MSE)
        grads = torch.autograd.grad([lg for lg, _ in pairs], flat, grad_outputs=[gg for _, gg in pairs],
                                    allow_unused=True)
    it = iter(grads)
    hvp = [sum_or_zero([next(it) for _ in ts], w) for w, ts in zip(weights, inputs, strict=True)]
    if comm is not None and comm.world_size > 1:
        all_reduce_list_(comm, hvp)
    return hvp, list(it)
