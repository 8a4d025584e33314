"""Step 3: teleport by gradient ascent on ½‖∇L‖², projected onto each layer's input null space.

eq. 5:   W_l ← W_l + η · π_l(∇_{W_l} L_teleport),   L_teleport = ½ ‖∇_W L‖²

(the paper's pseudo-code writes "−"; the text and the goal — a larger gradient norm at equal
loss — are ascent). ∇_W L_teleport = H·∇L is one double backward (``teleport.objective``).
Because π_l(U)·R_l = 0, every layer's output on the teleport batch is unchanged, so the batch
loss is too (exactly at τ = 1, within a bounded drift at τ < 1), while the downstream weights
that shape the backward pass have moved.

CAP (Algorithm 1): no step is taken once ‖∇L‖² ≥ CAP. A step that would overshoot CAP or raise
the batch loss by more than ``loss_tol`` (relative) is backed off by halving η.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch import Tensor, nn

from teleport import graph_cache
from teleport.ascent import Run, ascent_mode, early_reason, exact_tau
from teleport.bases import compute_bases, compute_basis, select_basis
from teleport.blocks import Block, RowClass, build_blocks, fixed_widths, partition
from teleport.capture import UseRecorder, trainable
from teleport.difference import check_dtypes, shift_params, unshift
from teleport.distributed import Collective, distributed_spectra
from teleport.eval_mode import evaluating
from teleport.executors import BasisExecutor, SerialExecutor
from teleport.objective import (
    LossFn,
    Objective,
    gradients,
    objective,
    objective_tensors,
    recorded_loss,
)
from teleport.on_device import UNCAPTURABLE, own_stream
from teleport.precision import ieee_float32
from teleport.rank_certificate import Proofs
from teleport.report import TeleportConfig, TeleportReport


def layer_bases(blocks: list[Block] | UseRecorder, tau: float, executor: BasisExecutor,
                comm: Collective | None = None, rule: str = "numerical_rank",
                proofs: Proofs | None = None) -> list[Block]:
    """Partition each block's rows into classes and give every class its basis, through ``executor``.

    ``blocks`` may be a recorder that has seen the forward (``capture_inputs``): its blocks are built.
    One basis per distinct representation (Q/K/V reading one tensor share theirs); in this process
    (the serial executor, or any R on a GPU) they are decomposed batched by shape. With a collective,
    the bases are those of the whole batch across ranks, identical on every rank. ``proofs``: what the full-rank
    certificate made of the model's earlier batches (``rank_certificate.Proofs``; batched in this process only).
    """
    if isinstance(blocks, UseRecorder):
        blocks = build_blocks(blocks.uses)[0]
    reps, slots = representations(blocks)
    if comm is not None and comm.world_size > 1:
        bases = [select_basis(spec, tau, rule) for spec in distributed_spectra(reps, comm, executor)]
    elif isinstance(executor, SerialExecutor) or any(r.device.type != "cpu" for r in reps):
        bases = compute_bases(reps, tau, rule, proofs)  # batched by shape; on a GPU always (one device, in turn)
    else:
        bases = executor.map(lambda r: compute_basis(r, tau, rule), reps)
    for cls, i in slots:
        cls.basis, cls.columns = bases[i], reps[i].shape[1]
    if comm is None or comm.world_size == 1:  # ranks keep their bases as they are: a shard's N is its own
        fixed_widths(blocks)
    return blocks


def representations(blocks: list[Block]) -> tuple[list[Tensor], list[tuple[RowClass, int]]]:
    """Partition each block's rows into classes: (every distinct R, each class with the index of its R)."""
    reps: list[Tensor] = []
    index: dict[tuple, int] = {}
    slots: list[tuple[RowClass, int]] = []
    for block in blocks:
        block.classes = partition(block)
        for cls in block.classes:
            key = cls.key(block.bias is not None, block.bias_id)
            if key not in index:
                index[key] = len(reps)
                reps.append(block.representation(cls))
            slots.append((cls, index[key]))
    return reps, slots


def scalar(t: Tensor) -> float:
    return float(t.detach())


def _shard_share(n: int, comm: Collective | None, device: torch.device) -> float:
    """w_r = n_r / N: this rank's weight in the whole batch's mean loss.

    Every rank learns every shard's size before any of them may raise, so an empty shard fails on
    every rank with the same error (one rank raising alone would leave the others in a collective).
    """
    if comm is None or comm.world_size == 1:
        if n == 0:
            raise ValueError("the teleport batch x is empty: pass at least one sample")
        return 1.0
    sizes = [int(s) for s in comm.all_gather(torch.tensor([n], dtype=torch.long, device=device))]
    empty = [r for r, s in enumerate(sizes) if s == 0]
    if empty:
        raise ValueError(f"the teleport batch x has an empty shard on rank(s) {empty} of {len(sizes)} "
                         f"(shard sizes {sizes}): give every rank at least one sample")
    return n / sum(sizes)


def heldout_loss(model: nn.Module, loss_fn: LossFn, holdout: tuple[Tensor, Tensor] | None) -> float | None:
    if holdout is None:
        return None
    with torch.no_grad():
        return scalar(loss_fn(model(holdout[0]), holdout[1]))


def _batch_size(x: Tensor) -> int:
    if x.dim() == 0:
        raise ValueError("the teleport batch x is a scalar: pass a batch with a leading sample dimension")
    return x.shape[0]


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
    and after, which — unlike the batch loss — is free to drift. A batch already at CAP, or whose
    loss is not finite (NaN targets, every target ignored), is decided before any basis is built.

    With ``comm`` (data-parallel ranks, see ``teleport.distributed``), (x, y) is this rank's shard
    of the teleport batch, at least one sample on every rank; pass the bare module, not a DDP wrapper
    (DDP's hooks would all-reduce inside the double backward). Every rank returns the same report
    and the same weights, or raises the same error. A caller's autocast (bf16 training) stops here: the
    teleport computes in the weights' own dtype, and float32 without TF32 (``teleport.precision``).
    """
    config = config or TeleportConfig()
    captured = ascent_mode(config, x.device, comm, model) == "cuda_graph" and model not in UNCAPTURABLE
    with (torch.autocast(x.device.type, enabled=False), ieee_float32(), own_stream(x.device, captured),
          graph_cache.own_leaves(model, captured)):
        if captured:  # every evaluation reads the model's static inputs: its captured tick may serve this batch
            x, y = graph_cache.static_inputs(model, x, y)
        return _teleport(model, loss_fn, x, y, config, executor, holdout, comm,
                         captured and config.steps > 0 and graph_cache.may_replay(model))


def _teleport(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, config: TeleportConfig,
              executor: BasisExecutor | None, holdout: tuple[Tensor, Tensor] | None,
              comm: Collective | None, deferred: bool = False) -> TeleportReport:
    """``deferred``: the model's CUDA graph may serve this batch, whose first tick evaluates L and ∇L at the start
    itself — the start's eager evaluation is then a forward alone, recording the uses (``recorded_loss``), and a
    backward only if the graph does not serve the batch after all (``ascent.Run.undefer``)."""
    start = time.perf_counter()
    with evaluating(model):
        names, params = trainable(model)
        share = _shard_share(_batch_size(x), comm, x.device)
        held = weakref.ref(model)  # a captured tick's closures outlive this call (``teleport.graph_cache``)

        exact = exact_tau(config)
        difference = config.hvp == "difference"  # no graph of ∇L is ever differentiated
        if difference:
            check_dtypes(params)

        def shifted(along: list[Tensor], eps: Tensor) -> list[Tensor]:
            saved = shift_params(params, along, eps)
            try:
                with torch.enable_grad():  # a device tick asks for its direction under no_grad
                    return gradients(_alive(held), loss_fn, x, y, params, comm, share)
            finally:
                unshift(params, saved)

        def tensors(graph: bool) -> tuple[Objective, Tensor]:
            return objective_tensors(_alive(held), loss_fn, x, y, params, None, share, None,
                                     graph and not difference, span_free=exact)

        def evaluate(recorder: UseRecorder | None = None, graph: bool = True,
                     fetch: tuple[Tensor, ...] = ()) -> Objective:
            return objective(model, loss_fn, x, y, params, comm, share, recorder, graph and not difference,
                             span_free=exact, fetch=fetch)

        heldout_before = heldout_loss(model, loss_fn, holdout)
        if checks_first(model, config):  # a plain forward + backward decides a batch at CAP (or not finite)
            first = objective(model, loss_fn, x, y, params, comm, share, graph=False)
            if reason := early_reason(first.loss, first.grad_norm_sq, config.cap):
                _AT_CAP[model] = reason == "cap"
                return TeleportReport(first.loss, first.loss, first.grad_norm_sq, first.grad_norm_sq, 0, 0, reason,
                                      time.perf_counter() - start, heldout_loss_before=heldout_before,
                                      heldout_loss_after=heldout_before, hvp=config.hvp)
        recorder = UseRecorder(names, params)
        # step 1: every use of every parameter, from the same forward as L
        cur = recorded_loss(model, loss_fn, x, y, recorder) if deferred else evaluate(recorder)
        blocks, untouched = build_blocks(recorder.uses)
        run = Run(model, params, blocks, cur, config, comm, shifted if difference else None, loss_fn)
        reason = run.decide_early()
        tried = reason == "steps"
        if tried:  # step 2 (bases), then step 3: t projected ascent steps
            layer_bases(run.blocks, config.tau, executor or SerialExecutor(), comm, config.tau_rule,
                        _PROOFS.setdefault(model, Proofs()))
            recorder.uses.keepalive.clear()  # the bases are all that is needed of R from here on
            reason = run.ascend(evaluate, tensors)
        run.undefer(evaluate, graph=False)  # a deferred start no tick read (no step was tried): for the report
        _AT_CAP[model] = run.gn0 >= run.config.cap  # at CAP before any step, read early or by the first tick
        return TeleportReport(
            loss_before=run.loss0,
            loss_after=run.cur.loss,
            grad_norm_sq_before=run.gn0,
            grad_norm_sq_after=run.cur.grad_norm_sq,
            steps=run.steps,
            backoffs=run.backoffs,
            stop_reason=reason,
            seconds=time.perf_counter() - start,
            layers=[r for block in run.blocks for r in block.reports()],
            untouched=untouched,
            heldout_loss_before=heldout_before,
            heldout_loss_after=heldout_loss(model, loss_fn, holdout) if tried else heldout_before,
            ascent=run.ascent,
            hvp=config.hvp,
            graph_replayed=run.graph_replayed,
        )


_AT_CAP: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()  # its last batch: at CAP, no basis
_PROOFS: weakref.WeakKeyDictionary[nn.Module, Proofs] = weakref.WeakKeyDictionary()  # its R the certificate failed


def checks_first(model: nn.Module, config: TeleportConfig) -> bool:
    """``TeleportConfig.check_first``; None: when the model's last teleport batch was at CAP before any basis (its
    next batch likely is too: after the first epochs most batches of a run are). Every rank of a data-parallel
    teleport reads the same reports, so every rank decides alike."""
    return _AT_CAP.get(model, False) if config.check_first is None else config.check_first


def _alive(held: weakref.ref[nn.Module]) -> nn.Module:
    model = held()
    assert model is not None, "a captured teleport outlived its model"
    return model
