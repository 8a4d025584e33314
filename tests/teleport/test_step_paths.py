"""What a teleport step skips or reuses (to cut its cost) changes nothing but the time.

A weight that reads only the data has a teleport gradient inside its inputs' span at τ = 1, so it
is not differentiated nor moved; the weights are stepped through a spare buffer instead of a copy,
bit for bit the same as ``W₀ + η·U``, and end in their own storage.
"""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teleport import SerialExecutor, TeleportConfig, capture_inputs, teleport_batch
from teleport.ascent.host import StepBuffers
from teleport.geometry.blocks import linear_only, moving_blocks
from teleport.geometry.layer_bases import layer_bases
from teleport.hvp.direction import project_blocks
from teleport.hvp.factored import factored_direction
from teleport.hvp.objective import objective, teleport_gradient, teleport_gradient_and

pytestmark = pytest.mark.usefixtures("float64")

CONFIG = TeleportConfig(steps=3, lr=0.3, cap=1e9, tau=1.0, loss_tol=1e-6)


def case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # 8 samples < 13 inputs of the first layer: it has free directions
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.randn(8, 12), torch.randint(0, 3, (8,))


def test_a_layer_reading_the_data_has_no_projected_teleport_gradient_and_stays() -> None:
    model, x, y = case()
    params = list(model.parameters())
    with capture_inputs(model) as captured:
        obj = objective(model, F.cross_entropy, x, y, params)
    blocks = layer_bases(captured, 1.0, SerialExecutor())
    grads = teleport_gradient(obj, [p for b in blocks for p in b.params], params)
    projected = project_blocks(blocks, grads)
    first, second = torch.cat([u.reshape(-1) for u in projected[:2]]), projected[2]
    assert blocks[0].reads_fixed_inputs and not blocks[1].reads_fixed_inputs
    assert blocks[0].classes[0].basis is not None and blocks[0].classes[0].basis.free_dims > 0
    assert first.norm() <= 1e-12 * torch.cat([g.reshape(-1) for g in grads[:2]]).norm()  # π(H·∇L) = 0
    assert second.norm() > 1e-3 * grads[2].norm()  # a deeper layer's is not

    before = copy.deepcopy(model)
    report = teleport_batch(model, F.cross_entropy, x, y, CONFIG)
    assert report.steps == CONFIG.steps and report.layers[0].free > 0
    assert torch.equal(model[0].weight, before[0].weight) and torch.equal(model[0].bias, before[0].bias)
    assert (model[2].weight - before[2].weight).norm() > 0
    assert abs(report.loss_after - report.loss_before) <= 1e-9 * report.loss_before


def test_a_data_layer_still_moves_at_tau_below_one() -> None:
    model, x, y = case()  # τ < 1: the dropped σ's directions are free and its gradient has a part there
    first = model[0].weight.detach().clone()
    teleport_batch(model, F.cross_entropy, x, y, TeleportConfig(steps=3, lr=0.3, cap=1e9, tau=0.9, loss_tol=1.0))
    assert (model[0].weight - first).norm() > 1e-6 * first.norm()


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_weights_end_in_their_own_storage_with_the_teleported_values(steps: int) -> None:
    model, x, y = case()
    ptrs = [p.data_ptr() for p in model.parameters()]
    view = model[2].weight.detach()[:4]  # someone holding a view of the storage sees the new values
    before = model[2].weight.detach().clone()
    report = teleport_batch(model, F.cross_entropy, x, y, TeleportConfig(**{**CONFIG.__dict__, "steps": steps}))
    assert report.steps == steps
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert torch.equal(view, model[2].weight[:4]) and not torch.equal(view, before[:4])


def test_a_refused_teleport_leaves_every_weight_bit_identical_in_place() -> None:
    """Every try refused (a loss that is NaN after the first evaluation: not a rounding race with loss_tol, which a
    GPU's float64 once won), and the weights are the ones before, bit for bit, in their own storage."""
    model, x, y = case()
    before = copy.deepcopy(model)
    ptrs = [p.data_ptr() for p in model.parameters()]

    def nan_once_moved(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():  # not a use of the weights: the recorder must not see it
            moved = any(not torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters(), strict=True))
        return F.cross_entropy(out, target) * (math.nan if moved else 1.0)

    report = teleport_batch(model, nan_once_moved, x, y,
                            TeleportConfig(steps=3, lr=1e6, cap=1e9, tau=1.0, loss_tol=1e-12, max_backoff=2))
    assert (report.steps, report.backoffs, report.stop_reason) == (0, 3, "not_finite")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters(), strict=True))
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_step_buffers_give_exactly_w0_plus_eta_u() -> None:
    torch.manual_seed(1)
    w = [nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(5))]
    home = [p.data_ptr() for p in w]
    u = [torch.randn(5, 4), torch.randn(5)]
    w0 = [p.detach().clone() for p in w]
    buffers = StepBuffers(w)
    buffers.move(u, 0.5)
    buffers.move(u, 0.25)  # a back-off: from W₀ again, not from the refused try
    assert all(torch.equal(p, torch.add(a, d, alpha=0.25)) for p, a, d in zip(w, w0, u, strict=True))
    buffers.restore()
    assert all(torch.equal(p, a) for p, a in zip(w, w0, strict=True))
    buffers.move(u, 0.5)
    buffers.accept()
    w1 = [p.detach().clone() for p in w]
    buffers.move(u, 0.125)
    buffers.accept()
    expected = [torch.add(a, d, alpha=0.125) for a, d in zip(w1, u, strict=True)]
    assert all(torch.equal(p, e) for p, e in zip(w, expected, strict=True))
    buffers.finish()
    assert [p.data_ptr() for p in w] == home
    assert all(torch.equal(p, e) for p, e in zip(w, expected, strict=True))


def test_span_free_linear_changes_h_grad_only_by_what_pi_removes() -> None:
    """With ``span_free`` the second backward leaves out each Linear's part through its own outputs, and
    with ``linear_only`` it runs through the backward graph alone (the weights' aliases)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
    params = list(model.parameters())
    with capture_inputs(model) as captured:
        objective(model, F.cross_entropy, x, y, params)
    blocks = moving_blocks(layer_bases(captured, 1.0, SerialExecutor()), 1.0, "numerical_rank")
    weights = [p for b in blocks for p in b.params]
    full, fast = (objective(model, F.cross_entropy, x, y, params, span_free=s) for s in (False, True))
    assert fast.loss == full.loss and fast.grad_norm_sq == pytest.approx(full.grad_norm_sq, rel=1e-13)
    h_full, h_fast = (teleport_gradient(o, weights, params) for o in (full, fast))
    assert torch.cat([(a - b).reshape(-1) for a, b in zip(h_full, h_fast, strict=True)]).norm() > 1e-3  # engaged
    only, again = linear_only(blocks), objective(model, F.cross_entropy, x, y, params, span_free=True)
    assert only and set(only) <= again.whole  # every moving weight here is a whole Linear: alias-only
    h_alias = teleport_gradient(again, weights, params, linear_only=only)  # no pass through the forward graph
    for h in (h_fast, h_alias):
        for u, v in zip(project_blocks(blocks, h_full), project_blocks(blocks, h), strict=True):
            assert (u - v).norm() <= 1e-10 * max(float(u.norm()), 1e-300)


class _Loop(nn.Module):
    """A Linear used twice (a loop), one without bias, 3-D activations: the factored π(H·∇L)'s cases."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.loop = nn.Linear(6, 10), nn.Linear(10, 10)
        self.nobias, self.head = nn.Linear(10, 10, bias=False), nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 2, 6)
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = torch.tanh(self.loop(h))
        return self.head(F.gelu(self.nobias(h)).mean(1))


def test_factored_direction_is_pi_of_the_whole_teleport_gradient() -> None:
    """π(δᵀC) from the factors δ, C of each use equals π of the full H·∇L (the step's own direction)."""
    torch.manual_seed(3)
    model = _Loop()
    x, y = torch.randn(2, 2, 6), torch.randint(0, 3, (2,))  # 2 uses x 4 columns < 11 inputs: free directions
    params = list(model.parameters())
    with capture_inputs(model) as captured:
        objective(model, F.cross_entropy, x, y, params)
    blocks = moving_blocks(layer_bases(captured, 1.0, SerialExecutor()), 1.0, "numerical_rank")
    weights = [p for b in blocks for p in b.params]
    assert {b.name for b in blocks} == {"loop", "nobias", "head"}
    expected = project_blocks(blocks, teleport_gradient(objective(model, F.cross_entropy, x, y, params), weights,
                                                        params))
    fast = objective(model, F.cross_entropy, x, y, params, span_free=True)
    assert len(fast.factors[id(model.loop.weight)]) == 2  # both uses of the looped Linear
    got = factored_direction(fast, blocks, None, teleport_gradient_and, project_blocks)
    for u, v in zip(expected, got, strict=True):
        assert u.shape == v.shape and (u - v).norm() <= 1e-10 * max(float(u.norm()), 1e-300)
    assert min(float(u.norm()) for u in expected) > 1e-6  # every block moves (the bias-free one too)


def test_a_span_free_objective_frees_its_graph() -> None:
    """The factors' sink is held weakly by the autograd nodes that fill it: no cycle keeps a step's graph alive."""
    model, x, y = case()
    obj = objective(model, F.cross_entropy, x, y, list(model.parameters()), span_free=True)
    sink = weakref.ref(obj.factors[id(model[2].weight)])
    del obj
    gc.collect()
    assert sink() is None
