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

from teleport.bases import Basis, BasisExecutor, SerialExecutor, compute_basis, project_split, select_basis
from teleport.capture import LayerInputs, capture_inputs, untouched_parameters
from teleport.distributed import Collective, all_reduce_list_, distributed_spectra
from teleport.report import LayerReport, TeleportConfig, TeleportReport

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


def objective(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    params: list[Tensor],
    comm: Collective | None = None,
    share: float = 1.0,
) -> Objective:
    """L(W) and ‖∇_W L‖² over every trainable parameter, keeping the graph for H·∇L.

    ``share`` is this rank's weight n_r / N in the whole batch's mean loss. Fused attention
    kernels (flash, memory-efficient) have no double backward: the math kernel of
    scaled_dot_product_attention is forced here.
    """
    with sdpa_kernel(SDPBackend.MATH):
        loss = loss_fn(model(x), y) * share
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    local = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    total = [g.detach() for g in local] + [loss.detach().reshape(1)]
    if comm is not None and comm.world_size > 1:
        total = [t.clone() for t in total]  # reduced in place: never into the graph's own tensors
        all_reduce_list_(comm, total)  # ∇L = Σ_r w_r ∇L_r, L = Σ_r w_r L_r: one collective
    global_grads, loss_sum = total[:-1], total[-1]
    # one host sync for both numbers; squares summed in float64 without copying the gradients
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in global_grads])
    gn2, loss_value = torch.stack([norms.pow(2).sum(), loss_sum[0].double()]).tolist()
    return Objective(loss_value, gn2, local, global_grads)


def teleport_gradient(obj: Objective, weights: list[Tensor], params: list[Tensor],
                      comm: Collective | None = None) -> list[Tensor]:
    """∇_W ½‖∇L‖² = H·∇L for ``weights`` (a subset of ``params``): the second backward.

    The backward of this rank's gradient graph against the global gradient gives w_r H_r·∇L;
    summed over ranks it is the whole batch's H·∇L.
    """
    pairs = [(lg, gg) for lg, gg in zip(obj.local_grads, obj.global_grads, strict=True) if lg.requires_grad]
    grads: tuple[Tensor | None, ...] = (None,) * len(weights)
    if pairs:  # no pair: no second-order path at all (e.g. a linear model on MSE)
        grads = torch.autograd.grad([lg for lg, _ in pairs], weights, grad_outputs=[gg for _, gg in pairs],
                                    allow_unused=True)
    hvp = [torch.zeros_like(w) if g is None else g for w, g in zip(weights, grads, strict=True)]
    if comm is not None and comm.world_size > 1:
        all_reduce_list_(comm, hvp)
    return hvp


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
        gb = grads[1] if len(grads) == 2 else None  # (C_o,)
        rows = gw.shape[0] // len(self.bases)
        parts = [project_split(gw[i * rows : (i + 1) * rows], None if gb is None else gb[i * rows : (i + 1) * rows],
                               b) for i, b in enumerate(self.bases)]
        if len(parts) == 1:
            uw, ub = parts[0]
        else:
            uw = torch.cat([p[0] for p in parts])
            ub = None if gb is None else torch.cat([p[1] for p in parts])  # type: ignore[misc]
        return [uw.reshape(grads[0].shape)] + ([] if ub is None else [ub])

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
    captured: dict[str, LayerInputs], tau: float, executor: BasisExecutor, comm: Collective | None = None
) -> list[_Layer]:
    """One basis per distinct representation (Q/K/V share theirs), computed through ``executor``.

    With a collective, the bases are those of the whole batch across ranks, identical on every rank.
    """
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
    if comm is not None and comm.world_size > 1:
        bases = [select_basis(spec, tau) for spec in distributed_spectra(reps, comm, executor)]
    else:
        bases = executor.map(lambda r: compute_basis(r, tau), reps)
    return [_Layer(e, [bases[i] for i in ids]) for e, ids in zip(captured.values(), slots, strict=True)]


def guarded_step(
    move: Callable[[float], None],
    restore: Callable[[], None],
    evaluate: Callable[[], Objective],
    loss0: float,
    eta: float,
    config: TeleportConfig,
) -> tuple[Objective | None, float, int, str]:
    """Take a step of size η, backing off (η/2) while it overshoots CAP or raises L beyond loss_tol.

    Returns the objective after the accepted step (None when every try failed and ``restore`` put
    the weights back), the η that worked (kept for the next step), the back-offs and, on failure,
    why: "cap" or "loss_tol".
    """
    for attempt in range(config.max_backoff + 1):
        move(eta)
        new = evaluate()
        over_cap = new.grad_norm_sq > config.cap
        loss_up = new.loss - loss0 > config.loss_tol * max(abs(loss0), 1e-12)
        if not (over_cap or loss_up):
            return new, eta, attempt, "steps"
        if attempt < config.max_backoff:
            eta /= 2
    restore()
    return None, eta, config.max_backoff + 1, "cap" if over_cap else "loss_tol"


def scalar(t: Tensor) -> float:
    return float(t.detach())


def _shard_share(n: int, comm: Collective | None, device: torch.device) -> float:
    """w_r = n_r / N: this rank's weight in the whole batch's mean loss."""
    if comm is None or comm.world_size == 1:
        return 1.0
    total = torch.tensor([float(n)], dtype=torch.float64, device=device)
    comm.all_reduce_(total)
    return n / float(total)


def heldout_loss(model: nn.Module, loss_fn: LossFn, holdout: tuple[Tensor, Tensor] | None) -> float | None:
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
    comm: Collective | None = None,
) -> TeleportReport:
    """Teleport ``model`` in place on one batch (Algorithm 1's inner loops for one of the b batches).

    Runs in eval mode (dropout off, BatchNorm on its running statistics, which are never changed)
    and restores the model's mode afterwards. ``holdout`` adds the loss on held-out data before
    and after, which — unlike the batch loss — is free to drift.

    With ``comm`` (data-parallel ranks, see ``teleport.distributed``), (x, y) is this rank's shard
    of the teleport batch; pass the bare module, not a DDP wrapper (DDP's hooks would all-reduce
    inside the double backward). Every rank returns the same report and the same weights.
    """
    config = config or TeleportConfig()
    executor = executor or SerialExecutor()
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        share = _shard_share(x.shape[0], comm, x.device)

        def evaluate() -> Objective:
            return objective(model, loss_fn, x, y, params, comm, share)

        heldout_before = heldout_loss(model, loss_fn, holdout)
        with capture_inputs(model) as captured:  # step 1: R per layer, from the same forward as L
            cur = evaluate()
        layers = layer_bases(captured, config.tau, executor, comm)  # step 2
        for layer in layers:  # the bases are all that is needed of R from here on
            layer.inputs.chunks = []
        loss0, gn0 = cur.loss, cur.grad_norm_sq
        weights = [p for layer in layers for p in layer.params]
        steps = backoffs = 0
        reason = "steps"
        eta = config.lr
        if not any(b.free_dims for layer in layers for b in layer.bases):
            reason = "no_free_directions"
        while reason == "steps" and steps < config.steps:  # step 3: t projected ascent steps
            if cur.grad_norm_sq >= config.cap:
                reason = "cap"
                break
            grads = teleport_gradient(cur, weights, params, comm)
            direction: list[Tensor] = []
            i = 0
            for layer in layers:
                n = len(layer.params)
                direction += layer.projected(grads[i : i + n])
                i += n
            origin = [w.detach().clone() for w in weights]

            def move(step: float, origin: list[Tensor] = origin, direction: list[Tensor] = direction) -> None:
                with torch.no_grad():
                    for w, w0, u in zip(weights, origin, direction, strict=True):
                        w.copy_(w0).add_(u, alpha=step)  # no temporaries of the weights' size

            new, eta, tries, why = guarded_step(move, lambda: move(0.0), evaluate, loss0, eta, config)
            backoffs += tries
            if new is None:
                reason = why
                break
            cur, steps = new, steps + 1
        return TeleportReport(
            loss_before=loss0,
            loss_after=cur.loss,
            grad_norm_sq_before=gn0,
            grad_norm_sq_after=cur.grad_norm_sq,
            steps=steps,
            backoffs=backoffs,
            stop_reason=reason,
            seconds=time.perf_counter() - start,
            layers=[r for layer in layers for r in layer.reports()],
            untouched=untouched_parameters(model, {layer.inputs.name: layer.inputs for layer in layers}),
            heldout_loss_before=heldout_before,
            heldout_loss_after=heldout_loss(model, loss_fn, holdout),
        )
    finally:
        model.train(was_training)
