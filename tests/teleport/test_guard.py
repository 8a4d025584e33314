"""The guard and edge inputs: no step is kept unless L and ‖∇L‖² are finite, within CAP and loss_tol either
way, and an ascent; odd inputs are handled or refused with one clear line. The τ rules (eq. 3) and precision."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from teleport import TeleportConfig, compute_basis, teleport_batch
from teleport.ascent.rules import step_verdict
from teleport.hvp.objective import Objective

pytestmark = pytest.mark.usefixtures("float64")

CONFIG = TeleportConfig(steps=3, lr=0.1, cap=1e9, tau=1.0, loss_tol=1e-6)


def mlp(d_in: int = 6, out: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, out))


def unchanged(model: nn.Module, before: nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters(), strict=True))


@pytest.mark.parametrize(
    ("new_loss", "new_gn", "verdict"),
    [(math.nan, 2.0, "not_finite"), (1.0, math.inf, "not_finite"), (1.0, 20.0, "cap"), (0.0, 2.0, "loss_tol"),
     (1.1, 2.0, "loss_tol"), (1.0, 0.5, "no_ascent"), (1.0 + 1e-9, 2.0, "steps")],
)
def test_step_verdict_looks_both_ways(new_loss: float, new_gn: float, verdict: str) -> None:
    config = TeleportConfig(cap=10.0, loss_tol=1e-3)
    assert step_verdict(new_loss, new_gn, 1.0, config, 1.0) == verdict


@pytest.mark.parametrize("case", ["nan_mse_target", "all_ignored"])
def test_non_finite_batch_loss_stops_before_any_step(case: str) -> None:
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(8, 6)
    if case == "nan_mse_target":
        y, loss_fn = torch.randn(8, 3), F.mse_loss
        y[2, 1] = math.nan
    else:
        y, loss_fn = torch.full((8,), -100), F.cross_entropy
    before = copy.deepcopy(model)
    report = teleport_batch(model, loss_fn, x, y, CONFIG)
    assert report.stop_reason == "not_finite" and report.steps == 0
    assert unchanged(model, before)


def test_the_guard_backs_off_a_fall_of_the_loss_too() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 16, 5))
    x, y = torch.randn(12, 3, 4, 4), torch.randint(0, 5, (12,))
    config = TeleportConfig(steps=5, lr=50.0, cap=1e9, tau=0.5, loss_tol=1e-4, max_backoff=3)
    report = teleport_batch(model, F.cross_entropy, x, y, config)
    assert report.backoffs > 0
    assert abs(report.loss_after - report.loss_before) <= 1e-4 * report.loss_before


class Counting:
    """An executor that counts the decompositions asked of it."""

    def __init__(self) -> None:
        self.calls = 0

    def map(self, fn, items):  # noqa: ANN001, ANN201 - the BasisExecutor protocol
        self.calls += len(items)
        return [fn(i) for i in items]


def test_a_batch_already_at_cap_builds_no_basis() -> None:
    torch.manual_seed(2)
    model, x, y = mlp(), torch.randn(8, 6), torch.randint(0, 3, (8,))
    executor = Counting()
    report = teleport_batch(model, F.cross_entropy, x, y, TeleportConfig(cap=1e-9), executor=executor)
    assert report.stop_reason == "cap" and report.steps == 0 and report.layers == []
    assert executor.calls == 0
    teleport_batch(model, F.cross_entropy, x, y, CONFIG, executor=executor)
    assert executor.calls == (3 if x.device.type == "cpu" else 0)  # on a GPU the bases are batched, not mapped


class Frozen(nn.Module):
    """A Linear whose weight is frozen (its bias alone may not move) and one whose bias is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.a.weight.requires_grad_(False)
        self.b.bias.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.b(input=torch.tanh(self.a(x)))))  # a keyword input


def test_frozen_parameters_and_keyword_inputs() -> None:
    torch.manual_seed(3)
    model, x, y = Frozen(), torch.randn(4, 6), torch.randint(0, 3, (4,))
    bias = model.a.bias.detach().clone()
    weight = model.b.weight.detach().clone()
    report = teleport_batch(model, F.cross_entropy, x, y, CONFIG)
    assert "not a trainable parameter" in report.untouched["a.bias"]
    assert torch.equal(model.a.bias, bias)
    assert (model.b.weight - weight).norm() > 0 and report.steps > 0
    assert abs(report.loss_after - report.loss_before) <= 1e-9 * report.loss_before


def test_an_empty_batch_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="empty"):
        teleport_batch(mlp(), F.cross_entropy, torch.randn(0, 6), torch.zeros(0, dtype=torch.long), CONFIG)


def test_unbatched_conv_input_moves_exactly() -> None:
    torch.manual_seed(4)

    class Unbatched(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 2)
            self.head = nn.Linear(4 * 2 * 2, 3)

        def forward(self, x: Tensor) -> Tensor:  # x: (C, H, W), one unbatched sample
            return self.head(torch.tanh(self.c2(torch.tanh(self.c1(x)))).flatten())

    model, x, y = Unbatched(), torch.randn(3, 5, 5), torch.tensor(1)
    weight = model.c2.weight.detach().clone()
    report = teleport_batch(model, F.cross_entropy, x, y, CONFIG)
    assert report.steps > 0 and (model.c2.weight - weight).norm() > 0
    assert abs(report.loss_after - report.loss_before) <= 1e-9 * report.loss_before


def test_low_precision_inputs_get_float32_bases_and_tolerance() -> None:
    torch.manual_seed(5)
    rep = torch.randn(16, 40).bfloat16()  # full rank: bf16's eps (0.5·σ₁ tolerance) would free directions
    basis = compute_basis(rep, 1.0)
    assert basis.rank == 16 and basis.free_dims == 0
    thin = compute_basis(rep[:, :10].contiguous(), 1.0)
    assert thin.rank == 10 and thin.kept is not None and thin.kept.dtype == torch.float32


def test_a_callers_autocast_does_not_reach_the_teleport() -> None:
    torch.manual_seed(7)
    model, x, y = mlp().float(), torch.randn(8, 6, dtype=torch.float32), torch.randint(0, 3, (8,))
    plain, mixed = copy.deepcopy(model), copy.deepcopy(model)
    config = TeleportConfig(steps=3, lr=0.2, cap=1e6)
    expected = teleport_batch(plain, F.cross_entropy, x, y, config)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):  # a bf16 training step around it
        report = teleport_batch(mixed, F.cross_entropy, x, y, config)
    assert report.steps == expected.steps > 0 and report.loss_after == expected.loss_after
    assert unchanged(mixed, plain)


def test_energy_rule_frees_the_negligible_tail_that_the_numerical_rank_keeps() -> None:
    torch.manual_seed(6)
    u, _ = torch.linalg.qr(torch.randn(30, 30))
    v, _ = torch.linalg.qr(torch.randn(200, 30))
    s = torch.cat([torch.logspace(0, -1, 26), torch.full((4,), 1e-4)])  # σ² of the tail ≈ 1e-8·σ₁²
    rep = (u @ torch.diag(s) @ v.T).float()
    exact, energy = compute_basis(rep, 1.0, "numerical_rank"), compute_basis(rep, 1.0, "energy")
    assert exact.rank == 30 and energy.rank == 26
    assert energy.captured_variance > 1 - 1e-6
    with pytest.raises(ValueError, match="teleport.tau_rule"):
        TeleportConfig(tau_rule="variance")


def test_the_spec_reaches_the_tau_rule() -> None:
    from api_schemas.spec import TeleportSpec
    from workers.train.build import teleport_config

    assert teleport_config(TeleportSpec(tau_rule="energy")).tau_rule == "energy"
    assert teleport_config(TeleportSpec()).tau_rule == "numerical_rank"


def test_a_cap_overshoot_is_shortened_by_the_secant_and_ends_the_teleport() -> None:
    from teleport.ascent.host import guarded_step

    state = {"eta": 0.0}

    def move(eta: float) -> None:
        state["eta"] = eta

    def evaluate() -> Objective:  # ‖∇L‖² grows linearly with η from 1
        return Objective(1.0, 1.0 + 10 * state["eta"], [], [])

    config = TeleportConfig(cap=5.0, loss_tol=1e-3, max_backoff=3)
    new, eta, tries, why = guarded_step(move, lambda: move(0.0), evaluate, 1.0, 1.0, config, 1.0)
    assert new is not None and why == "cap" and tries == 1
    assert eta == pytest.approx((0.95 * 5.0 - 1.0) / 10.0)  # one secant step lands at 0.95·CAP
    assert new.grad_norm_sq <= config.cap


def test_a_cap_overshoot_of_a_bending_curve_lands_at_cap_with_the_slope_and_short_of_it_by_the_chord() -> None:
    from teleport.ascent.host import guarded_step

    state = {"eta": 0.0}

    def move(eta: float) -> None:
        state["eta"] = eta

    def evaluate() -> Objective:  # ‖∇L‖² = 1 + 2η + 3η²: slope 2 at η = 0, convex along the step
        eta = state["eta"]
        return Objective(1.0, 1.0 + 2.0 * eta + 3.0 * eta**2, [], [])

    config = TeleportConfig(cap=5.0, loss_tol=1e-3, max_backoff=3)
    landed = {}
    for slope in (2.0, None):  # a try at η = 2 overshoots to 17: the first order predicted 5
        new, eta, tries, why = guarded_step(move, lambda: move(0.0), evaluate, 1.0, 2.0, config, 1.0, slope=slope)
        assert new is not None and why == "cap" and tries == 1
        landed[slope] = new.grad_norm_sq
    assert landed[2.0] == pytest.approx(0.95 * 5.0, abs=1e-9)  # the quadratic through the three is the curve
    assert landed[None] < 3.0  # the chord from 1 to 17 lands at 2.6: most of the way to CAP given up


def test_the_shortening_rule_is_one_function_on_host_floats_and_device_tensors() -> None:
    from teleport.ascent.rules import shorten, shorten_factor

    f64 = torch.float64
    for after, before, predicted in ((17.0, 1.0, 4.0), (9.0, 1.0, 8.0), (9.0, 1.0, 10.0), (6.0, 4.9, 0.1),
                                     (17.0, 1.0, math.inf), (17.0, 1.0, None)):
        tensor = shorten_factor(torch.tensor(after, dtype=f64), torch.tensor(before, dtype=f64), 5.0,
                                torch.tensor(math.nan if predicted is None else predicted, dtype=f64))
        factor = shorten("cap", after, before, 5.0, predicted)
        assert factor == float(tensor) and 0.05 <= factor <= 0.95
        if predicted is not None and 0 < predicted < after - before:  # it bends: the curve lands at 0.95·CAP
            bend = after - before - predicted
            assert before + predicted * factor + bend * factor**2 == pytest.approx(4.75) or factor == 0.05
    assert shorten("loss_tol", 17.0, 1.0, 5.0, 4.0) == 0.5  # anything but an overshoot of CAP: halved


def test_a_step_predicted_to_overshoot_cap_is_aimed_under_it_in_one_try() -> None:
    from teleport.ascent.host import guarded_step
    from teleport.ascent.rules import AIM, aim_on_device

    u = [torch.full((2, 2), 0.5)]  # ‖U‖² = 1: the predicted rise of ‖∇L‖² is 2η
    kept, shortened, slope = aim_on_device(0.1, 1.0, u, 5.0)  # 1 + 0.2 < CAP: η as it is
    assert float(slope) == pytest.approx(2.0)  # 2‖U‖²: what the guard shortens an overshoot of CAP by
    assert (float(kept), bool(shortened)) == (pytest.approx(0.1), False)
    eta_t, aimed_t, _ = aim_on_device(10.0, 1.0, u, 5.0)
    eta, aimed = float(eta_t), bool(aimed_t)
    assert aimed and eta == pytest.approx(AIM * 4.0 / 2.0)
    assert not bool(aim_on_device(10.0, 1.0, [torch.zeros(2, 2)], 5.0)[1])  # no slope: nothing to aim
    state, graphs = {"eta": 0.0}, []

    def move(step: float) -> None:
        state["eta"] = step

    def evaluate(graph: bool) -> Objective:  # ‖∇L‖² rises as predicted
        graphs.append(graph)
        return Objective(1.0, 1.0 + 2.0 * state["eta"], [], [])

    config = TeleportConfig(cap=5.0, loss_tol=1e-3)
    new, used, tries, why = guarded_step(move, lambda: move(0.0), lambda: evaluate(True), 1.0, eta, config, 1.0,
                                         final_evaluate=lambda: evaluate(False), aimed=True)
    assert new is not None and why == "cap" and tries == 0 and used == eta
    assert new.grad_norm_sq == pytest.approx(1.0 + AIM * 4.0) and new.grad_norm_sq <= config.cap
    assert graphs == [False]  # the teleport ends there: no graph is built for an H·∇L never asked for


def test_a_teleport_into_cap_ends_under_it() -> None:
    torch.manual_seed(5)
    model, x, y = mlp(), torch.randn(8, 6), torch.randint(0, 3, (8,))
    start = teleport_batch(copy.deepcopy(model), F.cross_entropy, x, y, TeleportConfig(steps=0))
    cap = start.grad_norm_sq_before * 1.2
    report = teleport_batch(model, F.cross_entropy, x, y, TeleportConfig(steps=8, lr=50.0, cap=cap))
    assert report.stop_reason == "cap" and report.steps >= 1
    assert start.grad_norm_sq_before < report.grad_norm_sq_after <= cap
