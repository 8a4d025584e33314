"""``teleport.reference`` is the oracle: the fast paths (the host guard, the device ticks, the CUDA graph's ticks
emulated on the CPU) take the same steps as the plain Algorithm 1, to rtol 1e-9 in float64, on every model family of
the tests and through every branch of the guard."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from teleport import TeleportConfig, Teleporter, TeleportReport, reference_teleport
from teleport.ascent.rules import AimScale
from tests.teleport.families import CASES, Case

pytestmark = pytest.mark.usefixtures("float64")

MOVING = TeleportConfig(steps=3, lr=0.1, cap=1e9, loss_tol=1.0)  # every step accepted as asked


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same(fast: TeleportReport, oracle: TeleportReport, moved: torch.nn.Module, plain: torch.nn.Module) -> None:
    assert (fast.stop_reason, fast.steps, fast.backoffs) == (oracle.stop_reason, oracle.steps, oracle.backoffs)
    for ours, theirs in ((fast.loss_after, oracle.loss_after), (fast.grad_norm_sq_after, oracle.grad_norm_sq_after),
                         (fast.grad_norm_sq_before, oracle.grad_norm_sq_before)):
        assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12)
    a, b = _weights(moved), _weights(plain)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12 * max(1.0, float(b.abs().max())))


def _both(case: Case, config: TeleportConfig, ascent: str) -> tuple[TeleportReport, TeleportReport]:
    fast_model, plain_model = copy.deepcopy(case.model), copy.deepcopy(case.model)
    fast = Teleporter(fast_model, case.loss_fn, replace(config, ascent=ascent)).teleport(case.x, case.y)
    oracle = reference_teleport(plain_model, case.loss_fn, case.x, case.y, config)
    _same(fast, oracle, fast_model, plain_model)
    return fast, oracle


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_family_steps_as_the_reference(name: str) -> None:
    case = CASES[name]()
    fast, _ = _both(case, MOVING, "host")
    moved = fast.steps > 0 and fast.grad_norm_sq_after > fast.grad_norm_sq_before
    assert moved or fast.stop_reason == "no_free_directions", fast


@pytest.mark.parametrize("name", ["linear", "tied_lm", "conv-conv2d_depthwise", "transformer-decoder-batch_first=True"])
@pytest.mark.parametrize("ascent", ["device", "cuda_graph"])
def test_the_device_ticks_step_as_the_reference(name: str, ascent: str, captures: list) -> None:
    """Eager ticks, and the CUDA graph's capture path emulated on the CPU (``captures``)."""
    _both(CASES[name](), MOVING, ascent)


def _gn(case: Case) -> float:
    return reference_teleport(copy.deepcopy(case.model), case.loss_fn, case.x, case.y,
                              replace(MOVING, steps=0)).grad_norm_sq_before


BRANCHES = {  # the guard's branches, each as a config of the batch's own ‖∇L‖² (gn)
    "overshoot shortened under CAP": lambda gn: TeleportConfig(steps=4, lr=50.0, cap=1.5 * gn, loss_tol=1.0),
    "aimed at CAP (rise, cap_ratio)": lambda gn: TeleportConfig(steps=4, rise=1.5, cap=float("inf"), cap_ratio=2.0),
    "loss_tol refuses every try": lambda gn: TeleportConfig(steps=2, lr=5.0, cap=1e9, tau=0.6, loss_tol=1e-14,
                                                            max_backoff=2),
    "already at CAP": lambda gn: TeleportConfig(steps=3, cap=0.5 * gn),
    "tau < 1 by the energy rule": lambda gn: TeleportConfig(steps=2, lr=0.05, cap=1e9, tau=0.95, tau_rule="energy",
                                                            loss_tol=1.0),
    "halved for drift": lambda gn: TeleportConfig(steps=3, lr=2.0, cap=1e9, tau=0.9, loss_tol=1e-3),
}


PATHS = [("linear", "host"), ("tied_lm", "host"), ("conv-conv2d_depthwise", "host"), ("linear", "device"),
         ("tied_lm", "device")]


@pytest.mark.parametrize("branch", sorted(BRANCHES))
@pytest.mark.parametrize(("name", "ascent"), PATHS)
def test_every_guard_branch_as_the_reference(branch: str, name: str, ascent: str) -> None:
    case = CASES[name]()
    _both(case, BRANCHES[branch](_gn(case)), ascent)


def test_the_branches_are_taken() -> None:
    """The configs above reach what they name (on the linear family), so the equalities test each branch."""
    case = CASES["linear"]()
    gn = _gn(case)
    seen = {b: reference_teleport(copy.deepcopy(case.model), case.loss_fn, case.x, case.y, f(gn))
            for b, f in BRANCHES.items()}
    assert seen["overshoot shortened under CAP"].stop_reason == "cap"
    assert seen["overshoot shortened under CAP"].backoffs >= 1
    assert seen["aimed at CAP (rise, cap_ratio)"].stop_reason == "cap"
    assert seen["loss_tol refuses every try"].stop_reason == "loss_tol"
    assert seen["loss_tol refuses every try"].steps == 0
    assert seen["already at CAP"].stop_reason == "cap" and seen["already at CAP"].steps == 0
    assert seen["halved for drift"].backoffs >= 1


def test_a_learned_aim_steps_as_the_reference() -> None:
    """Batch after batch the teleporter's learned aim changes the steps; the reference given the same aim agrees."""
    case = CASES["tied_lm"]()
    config = TeleportConfig(steps=3, rise=1.5, cap=float("inf"), cap_ratio=2.0)
    fast_model, plain_model = copy.deepcopy(case.model), copy.deepcopy(case.model)
    teleporter, aim = Teleporter(fast_model, case.loss_fn, config), AimScale(case.x.device)
    for _ in range(3):
        fast = teleporter.teleport(case.x, case.y)
        oracle = reference_teleport(plain_model, case.loss_fn, case.x, case.y, config, aim=aim)
        _same(fast, oracle, fast_model, plain_model)
    assert teleporter.aim is not None and float(teleporter.aim.now) == pytest.approx(float(aim.now), rel=1e-9)
    assert float(aim.now) < 1.0  # something was learned
