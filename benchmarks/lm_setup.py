"""Where a teleport batch's setup goes before its first step (part of ``benchmarks.lm_payoff``'s cost part).

Every teleport batch evaluates L and ∇L with every use of every weight recorded and computes its bases eagerly —
also when a CUDA graph replays its steps (``teleport.ascent.graphs``) — so on a GPU this is the part of a teleport
that launches kernels one by one and syncs, once a batch. Timed on the GPT-style LM's teleport batch, side by side,
each in seconds and in training steps:

- ``evaluation``: L and ∇L with the use recorder (``teleport.geometry.capture.UseRecorder``), no graph kept (the
  setup of ``teleport.hvp: difference``); ``plain_gradient``: the same forward and backward without the recorder — the
  recorder's host cost is the gap; ``recorded_forward``: the recorder's forward alone (``objective.recorded_loss``:
  the setup of a batch the model's CUDA graph serves, whose first replayed tick evaluates the start);
- ``bases``: ``compute_bases`` of the batch's R (float64, batched by shape: an R whose full rank is proven keeps its
  own span, CholeskyQR of R itself; the others by their eigenvalues), on the R's device; ``proven_full_rank``: how
  many R the certificate proved; ``bases_next_batch``: the same on the model's next batch, where an R the
  certificate failed goes straight to the eigenvalues (``certificate.Proofs``);
- ``certificate_device``: the full-rank certificate of the same Grams (``teleport.geometry.certificate``: Cholesky and
  the triangular inverse, batched — what the bases now take instead of eigenvalues wherever it proves rank N);
  ``eigvalsh_device``: the eigenvalues the bases took before (and take where it does not); ``eigh_device`` against
  ``eigh_host``: the whole float64 eigh of the same Gram matrices (what an R of lower rank needs) on the device, and
  on the host with the copies both ways — the least bases computed on the CPU (overlapped with GPU work) would cost.
  On the CPU the two are one route and ``eigh_host`` is not measured. ``eigh_host_pooled``: the eigh of the Grams the
  certificate did not prove, batch by batch, by ``teleport.geometry.eigh_route``'s host route (copied to the host, one
  Gram a thread of this process's torch threads, copied back), against ``eigh_device_unproven``: the same on the
  device; ``eigh_route``: what the model's teleporter's routes (``eigh_route.EighRoutes``, which the bases take too)
  chose for them (they measure on first use); ``eigh_host_one_thread``: the host route with one torch thread — a
  worker of the default ``resources.cpus_per_worker`` 1, whose pool is a loop (on a GPU the host route can then win
  only where the device's eigh is slower than the host's, one by one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from teleport.geometry import eigh_route
from teleport.geometry.bases import _batches_of, compute_bases, gram_batches, whole_spans
from teleport.geometry.blocks import build_blocks
from teleport.geometry.capture import UseRecorder, trainable
from teleport.geometry.certificate import Proofs, certify_full_rank
from teleport.geometry.eigh_route import EighRoutes
from teleport.geometry.layer_bases import representations
from teleport.hvp.objective import objective, recorded_loss
from teleport.modes import evaluating

Timed = Callable[[Callable[[], Any]], tuple[float, Any]]  # fn -> (its best seconds, its output)


def setup_phases(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, step_s: float,
                 timed: Timed, routes: EighRoutes | None = None) -> dict[str, Any]:
    """The setup's phases for the teleport batch (x, x) of ``model`` (see the module), against ``step_s``; ``routes``:
    the model's teleporter's eigh routes (``Teleporter.routes``), which its bases take and whose choices are
    reported (None: new ones, measured here)."""
    routes = EighRoutes() if routes is None else routes
    with evaluating(model):
        names, params = trainable(model)

        def evaluation() -> UseRecorder:
            recorder = UseRecorder(names, params)
            objective(model, loss_fn, x, x, params, None, 1.0, recorder, False)
            return recorder

        def plain() -> None:
            with sdpa_kernel(SDPBackend.MATH):
                torch.autograd.grad(loss_fn(model(x), x), params, allow_unused=True)

        seconds: dict[str, float] = {}
        seconds["evaluation"], recorder = timed(evaluation)
        seconds["plain_gradient"], _ = timed(plain)
        seconds["recorded_forward"], _ = timed(lambda: recorded_loss(model, loss_fn, x, x, UseRecorder(names, params)))
        reps, _ = representations(build_blocks(recorder.uses)[0])
        seconds["bases"], _ = timed(lambda: compute_bases(reps, 1.0, routes=routes))
        batches = gram_batches(reps)
        matrices = [g for _, _, _, g in batches]  # what the bases decompose
        proven = whole_spans(reps, batches)

        def remembered() -> None:  # the model's next batch of the same R: what the certificate failed is skipped
            proofs = Proofs()
            proofs.record(reps, list(range(len(reps))), set(proven))
            compute_bases(reps, 1.0, proofs=proofs, routes=routes)

        seconds["bases_next_batch"], _ = timed(remembered)
        unproven = [g for _, _, _, g in _batches_of(batches, [i for i in range(len(reps)) if i not in proven])]
        seconds["eigh_device_unproven"], _ = timed(lambda: [eigh_route.on_device(g) for g in unproven])

        def pooled() -> list[tuple[Tensor, Tensor]]:
            return [eigh_route.on_host(g) for g in unproven]

        seconds["eigh_host_pooled"], _ = timed(pooled)
        seconds["eigh_host_one_thread"], _ = timed(lambda: _one_thread(pooled))
        seconds["certificate_device"], _ = timed(lambda: [certify_full_rank(g, 1e-9) for g in matrices])
        seconds["eigvalsh_device"], _ = timed(lambda: [torch.linalg.eigvalsh(g) for g in matrices])
        seconds["eigh_device"], _ = timed(lambda: [torch.linalg.eigh(g) for g in matrices])
        if x.device.type != "cpu":
            seconds["eigh_host"], _ = timed(lambda: [[t.to(x.device) for t in torch.linalg.eigh(g.cpu())]
                                                     for g in matrices])
    return {"seconds": seconds, "in_train_steps": {k: v / step_s for k, v in seconds.items()},
            "representations": len(reps), "proven_full_rank": len(proven),
            "gram_batches": [list(g.shape) for g in matrices],
            "unproven_gram_batches": [list(g.shape) for g in unproven],
            "eigh_route": {k: v["route"] for k, v in routes.report().items()}}


def _one_thread(fn: Callable[[], Any]) -> Any:
    """``fn`` with one torch thread, the threads as they were after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)
