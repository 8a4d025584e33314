"""``teleport.rise``: each step's η from the relative rise of ‖∇L‖² it is predicted to make, not a fixed η; and
``teleport.cap_ratio``: each batch's CAP a multiple of its own ‖∇L‖² at its start.

A fixed η_tele moves models of other scales, and one model at other points of its training, by amounts that differ by
orders of magnitude (a char LM: η 2 took ‖∇L‖² from 2.5 to 5,000 at its first weights and from 3.91 to 3.912
after 31 Adam steps); a rise is the same share of ‖∇L‖² wherever it is taken.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from teleport import TeleportConfig, teleport_batch
from teleport.ascent.rules import aim_on_device
from teleport.hvp.objective import LossFn
from tests.teleport.families import CASES, OPEN, Case
from tests.teleport.test_on_device import assert_same, both, mlp

pytestmark = pytest.mark.usefixtures("float64")


def test_the_step_aims_at_the_share_of_grad_norm_sq_given() -> None:
    u = [torch.full((2, 2), 0.5)]  # ‖U‖² = 1: the predicted rise of ‖∇L‖² is 2η
    eta, aimed, _ = aim_on_device(7.0, 3.0, u, 1e9, rise=0.1)  # η ignored: 0.1 · 3 = 2η
    assert (float(eta), bool(aimed)) == (pytest.approx(0.15), False)
    eta, aimed, _ = aim_on_device(7.0, 3.0, u, 3.2, rise=0.1)  # the rise would pass CAP: aimed under it as with lr
    assert bool(aimed) and float(eta) < 0.1
    eta, _, _ = aim_on_device(7.0, 3.0, [torch.zeros(2, 2)], 1e9, rise=0.1)  # no slope: η, which moves nothing
    assert float(eta) == 7.0
    with pytest.raises(ValueError, match="teleport.rise must be > 0"):
        TeleportConfig(rise=0.0)


@pytest.mark.parametrize("name", ["linear", "conv-conv2d_same_dilated", "transformer-encoder-batch_first=True",
                                  "tied_lm", "llama"])
def test_one_small_step_raises_grad_norm_sq_by_about_that_share(name: str) -> None:
    case = CASES[name]()
    report = teleport_batch(case.model, case.loss_fn, case.x, case.y, replace(OPEN, steps=1, rise=0.01))
    rise = report.grad_norm_sq_after / report.grad_norm_sq_before - 1
    assert 0.008 < rise < 0.013  # first order: convex along the step, so a little over
    assert abs(report.loss_after - report.loss_before) <= 1e-9 * abs(report.loss_before)


def _scaled(loss_fn: LossFn, c: float) -> LossFn:
    """The loss in other units: ∇L × c, ‖∇L‖² × c²."""
    return lambda out, y: c * loss_fn(out, y)


def _moves(case: Case, config: TeleportConfig, c: float) -> list[Tensor]:
    model = copy.deepcopy(case.model)
    before = [p.detach().clone() for p in model.parameters()]
    teleport_batch(model, _scaled(case.loss_fn, c), case.x, case.y, config)
    return [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]


@pytest.mark.parametrize("bounded", [False, True], ids=["open", "cap_ratio"])
def test_a_rise_moves_a_model_the_same_whatever_the_loss_scale_a_fixed_lr_does_not(bounded: bool) -> None:
    case = CASES["linear"]()
    ratio = {"cap_ratio": 1.5, "cap": 1e9} if bounded else {}  # 4 steps of +20 % would pass ×1.5: CAP by aim
    rise, fixed = replace(OPEN, steps=4, rise=0.2, **ratio), replace(OPEN, steps=4, lr=0.5, **ratio)
    a, b = _moves(case, rise, 1.0), _moves(case, rise, 10.0)
    assert any(m.abs().max() > 1e-3 for m in a)
    for m, n in zip(a, b, strict=True):  # η ∝ 1/c², CAP ∝ c²: the same weights
        assert torch.allclose(m, n, rtol=1e-7, atol=1e-12)
    a, b = _moves(case, fixed, 1.0), _moves(case, fixed, 10.0)
    assert max(float((n - m).abs().max()) for m, n in zip(a, b, strict=True)) > 1e-3


@pytest.mark.parametrize("ascent", ["host", "device"])
def test_cap_ratio_stops_each_batch_at_that_multiple_of_its_own_grad_norm_sq(ascent: str) -> None:
    case = CASES["tied_lm"]()
    model = copy.deepcopy(case.model)
    config = TeleportConfig(steps=8, rise=0.3, cap=1e9, cap_ratio=2.0, ascent=ascent)
    first = teleport_batch(model, case.loss_fn, case.x, case.y, config)
    assert first.stop_reason == "cap" and 0 < first.steps < 8  # 8 steps of +30 % would pass ×2
    assert 1.5 * first.grad_norm_sq_before < first.grad_norm_sq_after <= 2.0 * first.grad_norm_sq_before
    second = teleport_batch(model, case.loss_fn, case.x, case.y, config)  # from there: ×2 again, not CAP's absolute
    assert second.grad_norm_sq_before == pytest.approx(first.grad_norm_sq_after, rel=1e-9)
    assert 1.5 * second.grad_norm_sq_before < second.grad_norm_sq_after <= 2.0 * second.grad_norm_sq_before
    low = teleport_batch(copy.deepcopy(case.model), case.loss_fn, case.x, case.y,
                         replace(config, cap=1.2 * first.grad_norm_sq_before))  # cap first: it binds
    assert low.grad_norm_sq_after <= 1.2 * first.grad_norm_sq_before
    with pytest.raises(ValueError, match="teleport.cap_ratio must be > 1"):
        TeleportConfig(cap_ratio=1.0)


@pytest.mark.parametrize("name", ["tied_lm", "llama"])
def test_one_step_that_overshoots_cap_ratio_lands_near_it_the_chord_fell_far_short(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]()
    config = TeleportConfig(steps=8, rise=1.5, cap=1e9, cap_ratio=2.0)  # aimed at 80 % of ×2: the curve overshoots

    def gain(ascent: str) -> float:
        report = teleport_batch(copy.deepcopy(case.model), case.loss_fn, case.x, case.y, replace(config, ascent=ascent))
        assert (report.steps, report.backoffs, report.stop_reason) == (1, 1, "cap")
        return report.grad_norm_sq_after / report.grad_norm_sq_before

    curve = gain("host")
    assert gain("device") == pytest.approx(curve, rel=1e-9)
    from teleport.ascent import host

    guarded = host.guarded_step  # without the slope: the secant from before to after alone
    monkeypatch.setattr(host, "guarded_step", lambda *a, **k: guarded(*a, **(k | {"slope": None})))
    assert 1.55 < curve <= 2.0 and gain("host") < curve - 0.1


@pytest.mark.parametrize("config", [replace(OPEN, steps=4, rise=0.3), replace(OPEN, steps=6, rise=1.0, cap=0.6),
                                    replace(OPEN, steps=4, rise=0.05, tau=0.8, loss_tol=1e-4),
                                    replace(OPEN, steps=6, rise=0.3, cap_ratio=1.5)],
                         ids=["open", "into_cap", "backoffs", "cap_ratio"])
def test_the_device_ticks_take_the_host_guards_rise_steps(config: TeleportConfig) -> None:
    a, b, host, other = both(mlp(), config)
    assert (a.ascent, b.ascent) == ("host", "device")
    assert_same(a, b, host, other)
    assert a.steps > 0 and (a.backoffs > 0 or config.tau == 1)
    assert (config.cap > 1 and config.cap_ratio is None) or a.stop_reason == "cap"


def test_a_spec_with_no_absolute_cap_bounds_each_batch_by_its_own() -> None:
    from api_schemas import build_spec
    from workers.train.build import teleport_config

    tp = build_spec({"teleport": {"rise": 0.3, "cap": None, "cap_ratio": 2}}).teleport
    config = teleport_config(tp)
    assert (config.cap, config.cap_ratio, config.rise) == (float("inf"), 2.0, 0.3)
    assert tp.calmer == "lower teleport.rise (now 0.3) or teleport.cap_ratio (now 2)"
    case = CASES["tied_lm"]()
    report = teleport_batch(case.model, case.loss_fn, case.x, case.y, config)
    assert report.stop_reason == "cap" and report.grad_norm_sq_after <= 2.0 * report.grad_norm_sq_before


def test_symmetry_teleport_takes_the_same_rise_and_cap_ratio() -> None:
    # the baseline a lab compares with: sized and bounded the same way, so a comparison is of the methods
    from teleport import symmetry_teleport_batch
    from tests.teleport.test_teleport import MLP

    torch.manual_seed(6)
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))

    torch.manual_seed(7)
    one = symmetry_teleport_batch(MLP([20, 32, 32, 5]), torch.nn.functional.cross_entropy, x, y,
                                  TeleportConfig(steps=1, cap=1e9, loss_tol=1.0, rise=1e-3))
    # first order, from the model itself (g = I is the identity); its curve bends fast: a rise of 1 % gives 1.8 %
    assert 0.8e-3 < one.grad_norm_sq_after / one.grad_norm_sq_before - 1 < 1.3e-3
    capped = symmetry_teleport_batch(MLP([20, 32, 32, 5]), torch.nn.functional.cross_entropy, x, y,
                                     TeleportConfig(steps=8, rise=0.3, cap=1e9, cap_ratio=1.5, loss_tol=1.0))
    assert capped.stop_reason == "cap" and capped.steps >= 1
    assert capped.grad_norm_sq_before < capped.grad_norm_sq_after <= 1.5 * capped.grad_norm_sq_before
    torch.manual_seed(7)  # the scale-free setting: one step past ×2, shortened under it, and that ends the teleport
    one = symmetry_teleport_batch(MLP([20, 32, 32, 5]), torch.nn.functional.cross_entropy, x, y,
                                  TeleportConfig(steps=8, rise=1.5, cap=1e9, cap_ratio=2.0, loss_tol=1.0))
    assert (one.steps, one.stop_reason) == (1, "cap") and one.backoffs >= 1  # it went on stepping: 4 steps
    assert 1.2 < one.grad_norm_sq_after / one.grad_norm_sq_before <= 2.0
