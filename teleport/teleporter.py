"""``Teleporter``: teleportation of one model (paper Algorithm 1), its state explicit and saved with ``state_dict``.

eq. 5:   W_l ← W_l + η · π_l(∇_{W_l} L_teleport),   L_teleport = ½ ‖∇_W L‖²

(the paper's pseudo-code writes "−"; the text and the goal — a larger gradient norm at equal loss — are ascent).
Because π_l(U)·R_l = 0, every layer's output on the teleport batch is unchanged, so the batch loss is too (exactly at
τ = 1, within a bounded drift at τ < 1), while the downstream weights that shape the backward pass have moved.

One batch, in order (``teleport``):
1. capture every use of every parameter in the forward that gives L and ∇L (``teleport.geometry.capture``);
2. the blocks that can move and their bases by the τ rule (``teleport.geometry``);
3. up to t projected ascent steps on ½‖∇L‖², held to CAP and the guard (``teleport.ascent``), each along
   U = π(H·∇L) (``teleport.hvp``).
``teleport.reference`` is the same algorithm with none of the speed paths: read it first.

What a teleport carries from one batch to the next of the same model lives here, never at module level: the learned
aim at CAP and the difference's shift (they change the steps taken), whether the last batch was at CAP, the rank
certificate's memory, the measured eigh routes, the CUDA graph and its static inputs (they change the cost), and the
host reads made. ``state_dict`` holds all but the graph (which a resumed run captures again).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from teleport.ascent.choose import ascent_mode, choose
from teleport.ascent.graphs import GraphCache
from teleport.ascent.rules import AimScale, early_reason
from teleport.ascent.run import AscentBatch
from teleport.config import TeleportConfig
from teleport.distributed import Collective
from teleport.executors import BasisExecutor, SerialExecutor
from teleport.geometry.blocks import build_blocks
from teleport.geometry.capture import UseRecorder, trainable
from teleport.geometry.certificate import Proofs
from teleport.geometry.eigh_route import EighRoutes
from teleport.geometry.layer_bases import layer_bases
from teleport.hvp.difference import ShiftScale, check_dtypes, shift_params, unshift
from teleport.hvp.direction import exact_tau
from teleport.hvp.objective import (
    HostReads,
    LossFn,
    Objective,
    gradients,
    heldout_loss,
    objective,
    objective_tensors,
    recorded_loss,
)
from teleport.modes import evaluating, ieee_float32
from teleport.report import TeleportReport

STATE_VERSION = 1


class Teleporter:
    """Teleports ``model`` in place, batch after batch, and keeps what one batch teaches the next.

    >>> teleporter = Teleporter(model, F.cross_entropy, TeleportConfig(steps=8, cap=5.0))
    >>> report = teleporter.teleport(x, y)            # loss on (x, y) unchanged, ‖∇L‖² up to CAP
    >>> torch.save({"model": model.state_dict(), "teleporter": teleporter.state_dict()}, path)

    ``executor``: who decomposes the representations (``teleport.executors``; in turn by default). ``comm``:
    data-parallel ranks (``teleport.distributed``): (x, y) is then this rank's shard of the teleport batch, at least
    one sample on every rank; pass the bare module, not a DDP wrapper (DDP's hooks would all-reduce inside the double
    backward). Every rank returns the same report and the same weights, or raises the same error.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, config: TeleportConfig | None = None, *,
                 executor: BasisExecutor | None = None, comm: Collective | None = None,
                 eigh_route: str | None = None) -> None:
        self.model, self.loss_fn, self.config = model, loss_fn, config or TeleportConfig()
        self.executor, self.comm = executor or SerialExecutor(), comm
        self.aim: AimScale | None = None  # the learned factor on a step aimed at CAP (``rules.AimScale``)
        self.shift: ShiftScale | None = None  # the learned factor on a difference's shift (``hvp.difference``)
        self.at_cap = False  # the last batch was at CAP before any basis: the next one checks first
        self.proofs = Proofs()  # which R the rank certificate could not prove, batch after batch
        self.routes = EighRoutes(eigh_route)  # where each shape's eigh runs fastest, measured
        self.graphs = GraphCache()  # the captured tick, its static inputs and stream (``ascent: cuda_graph``)
        self.reads = HostReads()  # device values read on the host: one sync each on a GPU

    def teleport(self, x: Tensor, y: Tensor, *, holdout: tuple[Tensor, Tensor] | None = None,
                 config: TeleportConfig | None = None) -> TeleportReport:
        """Teleport the model on the batch (x, y) (Algorithm 1's inner loops for one of its b batches).

        Runs in eval mode (dropout off, BatchNorm on its running statistics, which are never changed) and restores
        every module's mode afterwards. ``holdout`` adds the loss on held-out data before and after, which — unlike
        the batch loss — is free to drift. A batch already at CAP, or whose loss is not finite, is decided before any
        basis is built. ``config`` overrides the teleporter's for this batch (a budget's fewer steps). A caller's
        autocast stops here: the teleport computes in the weights' own dtype, float32 without TF32.
        """
        config = config or self.config
        mode = ascent_mode(config, x.device, self.comm, self.graphs)
        captured = mode == "cuda_graph" and not self.graphs.capturing.failed  # a model no graph holds: eager ticks
        with (torch.autocast(x.device.type, enabled=False), ieee_float32(),
              self.graphs.capturing.own_stream(x.device, captured), self.graphs.own_leaves(self.model, captured)):
            if captured:  # every evaluation reads the static inputs: the model's captured tick may serve this batch
                x, y = self.graphs.static_inputs(x, y)
            deferred = captured and config.steps > 0 and self.graphs.may_replay()
            with evaluating(self.model):
                return self._teleport(x, y, config, holdout, mode, deferred)

    def _teleport(self, x: Tensor, y: Tensor, config: TeleportConfig, holdout: tuple[Tensor, Tensor] | None,
                  mode: str, deferred: bool) -> TeleportReport:
        """``deferred``: the model's CUDA graph may serve this batch, whose first tick evaluates L and ∇L at the
        start itself — the start's eager evaluation is then a forward alone, recording the uses (``recorded_loss``),
        and a backward only if the graph does not serve the batch after all (``AscentBatch.undefer``)."""
        start, model, loss_fn, comm = time.perf_counter(), self.model, self.loss_fn, self.comm
        names, params = trainable(model)
        share = shard_share(batch_size(x), comm, x.device)
        held = weakref.ref(model)  # a captured tick's closures outlive this call (``teleport.ascent.graphs``)
        exact, difference = exact_tau(config), config.hvp == "difference"  # difference: ∇L's graph never kept
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
                             span_free=exact, fetch=fetch, reads=self.reads)

        heldout_before = heldout_loss(model, loss_fn, holdout)
        if self.at_cap if config.check_first is None else config.check_first:  # a plain pass decides a batch at CAP
            first = objective(model, loss_fn, x, y, params, comm, share, graph=False, reads=self.reads)
            if reason := early_reason(first.loss, first.grad_norm_sq, config.cap):
                self.at_cap = reason == "cap"
                return TeleportReport(first.loss, first.loss, first.grad_norm_sq, first.grad_norm_sq, 0, 0, reason,
                                      time.perf_counter() - start, heldout_loss_before=heldout_before,
                                      heldout_loss_after=heldout_before, hvp=config.hvp)
        recorder = UseRecorder(names, params)
        # step 1: every use of every parameter, from the same forward as L
        cur = recorded_loss(model, loss_fn, x, y, recorder, self.reads) if deferred else evaluate(recorder)
        blocks, untouched = build_blocks(recorder.uses)
        like = params[0]
        batch = AscentBatch(model, params, blocks, cur, config, comm, loss_fn, self._aim(like),
                            shifted if difference else None, self._shift(like) if difference else None, self.reads)
        reason = batch.decide_early()
        tried = reason == "steps"
        if tried:  # step 2 (bases), then step 3: t projected ascent steps
            layer_bases(batch.blocks, config.tau, self.executor, comm, config.tau_rule, self.proofs, self.routes)
            recorder.uses.keepalive.clear()  # the bases are all that is needed of R from here on
            layers = [r for block in batch.blocks for r in block.reports()]
            reason = batch.moving() or self._ascend(batch, mode, evaluate, tensors)
        else:
            layers = []
        batch.undefer(evaluate, graph=False)  # a deferred start no tick read (no step was tried): for the report
        self.at_cap = batch.gn0 >= batch.config.cap  # at CAP before any step, read early or by the first tick
        return TeleportReport(
            loss_before=batch.loss0, loss_after=batch.cur.loss,
            grad_norm_sq_before=batch.gn0, grad_norm_sq_after=batch.cur.grad_norm_sq,
            steps=batch.steps, backoffs=batch.backoffs, stop_reason=reason, seconds=time.perf_counter() - start,
            layers=layers, untouched=untouched, heldout_loss_before=heldout_before,
            heldout_loss_after=heldout_loss(model, loss_fn, holdout) if tried else heldout_before,
            ascent=batch.ascent, hvp=config.hvp, graph_replayed=batch.graph_replayed,
        )

    def _ascend(self, batch: AscentBatch, mode: str, evaluate: Any, tensors: Any) -> str:
        batch.ascent = mode
        return choose(mode, self.graphs)(batch, evaluate, tensors)

    def _aim(self, like: Tensor) -> AimScale:
        self.aim = _on_device(self.aim, AimScale, like)
        return self.aim

    def _shift(self, like: Tensor) -> ShiftScale:
        self.shift = _on_device(self.shift, ShiftScale, like)
        return self.shift

    def state_dict(self) -> dict[str, Any]:
        """Everything a later teleport of the model depends on, as plain numbers, lists and strings (a checkpoint
        loads it with ``torch.load(weights_only=True)`` or JSON); the CUDA graph is not in it."""
        return {"version": STATE_VERSION, "aim": None if self.aim is None else self.aim.state_dict(),
                "shift": None if self.shift is None else self.shift.state_dict(), "at_cap": self.at_cap,
                "proofs": self.proofs.state_dict(), "eigh_routes": self.routes.state_dict(),
                "host_reads": self.reads.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict``'s state: the next teleport takes the steps it would have taken."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"teleporter state version {state.get('version')!r}: this library reads {STATE_VERSION}")
        like = next((p for p in self.model.parameters()), torch.empty(0))
        self.aim = None if state["aim"] is None else _loaded(AimScale, like, state["aim"])
        self.shift = None if state["shift"] is None else _loaded(ShiftScale, like, state["shift"])
        self.at_cap = bool(state["at_cap"])
        self.proofs.load_state_dict(state["proofs"])
        self.routes.load_state_dict(state["eigh_routes"])
        self.reads.count = int(state["host_reads"])


def teleport_batch(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, config: TeleportConfig | None = None,
                   executor: BasisExecutor | None = None, holdout: tuple[Tensor, Tensor] | None = None,
                   comm: Collective | None = None) -> TeleportReport:
    """One teleport of ``model`` on (x, y) by a fresh ``Teleporter``: nothing is learned from or kept for other
    batches (a loop that teleports again keeps a ``Teleporter``)."""
    return Teleporter(model, loss_fn, config, executor=executor, comm=comm).teleport(x, y, holdout=holdout)


def _on_device(scale: Any, kind: type, like: Tensor) -> Any:
    """``scale`` on ``like``'s device (made there, its value kept, when the model moved); a new one when None."""
    if scale is not None and scale.now.device == like.device:
        return scale
    return kind(like.device) if scale is None else _loaded(kind, like, scale.state_dict())


def _loaded(kind: type, like: Tensor, state: dict[str, float]) -> Any:
    scale = kind(like.device)
    scale.load_state_dict(state)
    return scale


def shard_share(n: int, comm: Collective | None, device: torch.device) -> float:
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


def batch_size(x: Tensor) -> int:
    if x.dim() == 0:
        raise ValueError("the teleport batch x is a scalar: pass a batch with a leading sample dimension")
    return x.shape[0]


def _alive(held: weakref.ref[nn.Module]) -> nn.Module:
    model = held()
    assert model is not None, "a captured teleport outlived its model"
    return model
