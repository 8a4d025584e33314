"""A step aimed at CAP learns from the model's earlier aimed steps (``teleport.ascent.rules.AimScale``): a model whose
‖∇L‖² bends up steeply along the step overshoots CAP once, on its first batch, and lands under it at the first try
after; the host guard and the device ticks learn the same factor."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from teleport import TeleportConfig, Teleporter
from teleport.ascent.rules import AIM, M_MIN, AimScale, aim_on_device, aims_first
from tests.teleport.families import CASES, Case

pytestmark = pytest.mark.usefixtures("float64")

SCALE_FREE = TeleportConfig(steps=8, rise=1.5, cap=float("inf"), cap_ratio=2.0, loss_tol=1e-3)


def test_the_factor_is_the_eta_that_landed_nudged_toward_the_target() -> None:
    scale = AimScale(torch.device("cpu"))
    f64 = {"dtype": torch.float64}
    yes, no = torch.tensor(True), torch.tensor(False)
    gap = torch.tensor(1.0, **f64)
    # shortened to a quarter of its first try, it rose by 1/16 of the aim's target: m = 0.25 · 16^¼ = 0.5
    scale.learn(yes, torch.tensor(2.0, **f64), torch.tensor(0.5, **f64), torch.tensor(AIM / 16, **f64), gap)
    assert float(scale.now) == pytest.approx(0.5)
    scale.learn(no, torch.tensor(2.0, **f64), torch.tensor(0.01, **f64), torch.tensor(1e-3, **f64), gap)  # not used
    assert float(scale.now) == pytest.approx(0.5)
    scale.learn(yes, torch.tensor(1.0, **f64), torch.tensor(1.0, **f64), torch.tensor(1e-12, **f64), gap)
    assert float(scale.now) == 1.0  # never past the first-order aim
    scale.learn(yes, torch.tensor(1.0, **f64), torch.tensor(1e-9, **f64), torch.tensor(AIM, **f64), gap)
    assert float(scale.now) == M_MIN
    u = [torch.full((2, 2), 0.5)]  # ‖U‖² = 1: the predicted rise is 2η
    eta, aimed, _ = aim_on_device(10.0, 1.0, u, 5.0, scale=scale)
    assert bool(aimed) and float(eta) == pytest.approx(M_MIN * AIM * 4.0 / 2.0)


@pytest.mark.parametrize(("rise", "ratio", "said"), [(1.5, 2.0, True), (1.01, 2.0, True), (3.5, 4.0, True),
                                                     (1.0, 2.0, False), (0.3, 2.0, False), (3.0, 4.0, False),
                                                     (1.5, None, False), (None, 2.0, False)])
def test_step_one_is_aimed_where_aims_first_says(rise: float | None, ratio: float | None, said: bool) -> None:
    """``aims_first`` (known on the host) never says aimed where ``aim_on_device`` does not aim step 1: random
    batches' ‖∇L‖², slopes and CAPs, the batch's CAP as ``TeleportConfig.for_batch`` makes it."""
    gen = torch.Generator().manual_seed(0)
    assert aims_first(rise, ratio) == said
    for _ in range(200):
        gn, u_sq, cap = (float(10 ** (8 * torch.rand((), generator=gen) - 4)) for _ in range(3))
        config = TeleportConfig(steps=1, lr=0.1, cap=gn + cap, rise=rise, cap_ratio=ratio).for_batch(gn)
        u = [torch.full((1,), u_sq**0.5, dtype=torch.float64)]
        _, aimed, _ = aim_on_device(config.lr, gn, u, config.cap, rise)
        assert bool(aimed) or not said, (gn, u_sq, config.cap)


def _steep() -> Case:
    """The char LM of the test families, its ‖∇L‖² bending up along the step far past the first order's rise."""
    return CASES["tied_lm"]()


def _batches(teleporter: Teleporter, case: Case, n: int) -> list:
    """n teleports of the teleporter's model from its weights as they are now, each on the case's batch."""
    model = teleporter.model
    start = copy.deepcopy(model.state_dict())
    reports = []
    for _ in range(n):
        model.load_state_dict(start)
        reports.append(teleporter.teleport(case.x, case.y))
    return reports


def test_a_steep_model_overshoots_cap_on_its_first_batch_only() -> None:
    case = _steep()
    teleporter = Teleporter(case.model, case.loss_fn, replace(SCALE_FREE, ascent="host"))
    reports = _batches(teleporter, case, 4)
    assert [r.stop_reason for r in reports] == ["cap"] * 4
    assert reports[0].backoffs >= 1  # the first-order aim overshot CAP and was shortened
    assert [r.backoffs for r in reports[1:]] == [0, 0, 0]  # the learned aim lands under it at the first try
    for r in reports:
        assert 1.0 < r.grad_norm_sq_after / r.grad_norm_sq_before <= 2.0
        assert abs(r.loss_after - r.loss_before) <= 1e-9 * abs(r.loss_before)
    assert teleporter.aim is not None and float(teleporter.aim.now) < 1.0
    assert teleporter.state_dict()["aim"]["now"] == float(teleporter.aim.now)  # saved with the teleporter


@pytest.mark.parametrize("ascent", ["device", pytest.param("cuda_graph", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_the_device_ticks_learn_the_host_guards_factor(ascent: str) -> None:
    """The ticks (eager; on CUDA captured in a graph that replays for the later batches) against the host guard."""
    case = _steep()
    if ascent == "cuda_graph":
        case = Case(case.model.cuda(), case.x.cuda(), case.y.cuda(), case.moved, case.loss_fn)
    host, ticks = copy.deepcopy(case.model), copy.deepcopy(case.model)
    on_host = Teleporter(host, case.loss_fn, replace(SCALE_FREE, ascent="host"))
    on_ticks = Teleporter(ticks, case.loss_fn, replace(SCALE_FREE, ascent=ascent))
    by_host, by_ticks = _batches(on_host, case, 3), _batches(on_ticks, case, 3)
    assert all(r.ascent in ("device", "cuda_graph") for r in by_ticks)  # a graph once captured (batch 1's 3rd tick)
    assert [(r.steps, r.backoffs) for r in by_ticks] == [(r.steps, r.backoffs) for r in by_host]
    assert on_host.aim is not None and on_ticks.aim is not None
    m_host, m_ticks = float(on_host.aim.now), float(on_ticks.aim.now)
    assert m_ticks == pytest.approx(m_host, rel=1e-9) and m_host < 1.0
    for p, q in zip(host.parameters(), ticks.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-9, atol=1e-12)
