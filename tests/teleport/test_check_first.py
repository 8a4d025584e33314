"""``TeleportConfig.check_first``: a plain forward + backward decides a batch at CAP (or not finite) before the
recorded evaluation, which records every use of every parameter and keeps ∇L's graph. It changes the time, never
the outcome: a batch that steps ends bit for bit where it ends without the check. By default (None) a model's
batch is checked first when its last one was at CAP before any basis."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from teleport import TeleportConfig, Teleporter, teleport_batch
from tests.teleport import families

pytestmark = pytest.mark.usefixtures("float64")

CHECK = replace(families.OPEN, check_first=True)
CHECKED = ["linear", "tied_lm", "transformer-encoder-batch_first=True", "conv-conv2d_depthwise"]


def _modes_seen(loss_fn: families.LossFn) -> tuple[families.LossFn, list[int]]:
    """``loss_fn``, and the torch-function modes active at each of its calls beyond the test's own (the recorder is
    one; ``TLAB_TEST_DEVICE``'s default device is one the test itself runs under)."""
    seen: list[int] = []
    own = torch._C._len_torch_function_stack()

    def counted(out: Tensor, y: Tensor) -> Tensor:
        seen.append(torch._C._len_torch_function_stack() - own)
        return loss_fn(out, y)

    return counted, seen


@pytest.mark.parametrize("name", CHECKED)
def test_a_batch_that_steps_ends_bit_for_bit_where_it_ends_unchecked(name: str) -> None:
    case = families.CASES[name]()
    twin = copy.deepcopy(case.model)
    checked = teleport_batch(case.model, case.loss_fn, case.x, case.y, CHECK)
    unchecked = teleport_batch(twin, case.loss_fn, case.x, case.y, replace(families.OPEN, check_first=False))
    assert checked.steps == unchecked.steps == families.OPEN.steps
    for a, b in zip(case.model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    assert (checked.loss_before, checked.grad_norm_sq_before) == (unchecked.loss_before, unchecked.grad_norm_sq_before)
    assert checked.layers == unchecked.layers and checked.untouched == unchecked.untouched


@pytest.mark.parametrize("name", CHECKED)
def test_a_batch_at_cap_is_decided_by_one_plain_pass_and_nothing_moves(name: str) -> None:
    case = families.CASES[name]()
    before = copy.deepcopy(case.model)
    loss_fn, seen = _modes_seen(case.loss_fn)
    config = replace(CHECK, cap=1e-12)
    report = teleport_batch(case.model, loss_fn, case.x, case.y, config, holdout=(case.x, case.y))
    assert report.stop_reason == "cap" and report.steps == 0
    assert seen == [0, 0]  # the holdout's forward and the check: no recorder, no second forward, no holdout after
    assert report.heldout_loss_after == report.heldout_loss_before == pytest.approx(report.loss_before, rel=1e-12)
    for a, b in zip(case.model.parameters(), before.parameters(), strict=True):
        assert torch.equal(a, b)

    loss_fn, seen = _modes_seen(case.loss_fn)
    unchecked = teleport_batch(case.model, loss_fn, case.x, case.y, replace(config, check_first=False))
    assert unchecked.stop_reason == "cap" and len(seen) == 1 and seen[0] > 0  # the recorded evaluation decided
    assert report.loss_before == pytest.approx(unchecked.loss_before, rel=1e-12)
    assert report.grad_norm_sq_before == pytest.approx(unchecked.grad_norm_sq_before, rel=1e-10)


def test_a_batch_whose_loss_is_not_finite_is_decided_by_the_check() -> None:
    case = families.linear()
    loss_fn, seen = _modes_seen(lambda out, y: F.cross_entropy(out, y) * torch.nan)
    report = teleport_batch(case.model, loss_fn, case.x, case.y, CHECK)
    assert report.stop_reason == "not_finite" and seen == [0]


def test_without_the_check_a_batch_at_cap_still_skips_the_bases_and_its_holdout_after() -> None:
    case = families.linear()
    loss_fn, seen = _modes_seen(case.loss_fn)
    config = TeleportConfig(cap=1e-12, check_first=False)
    report = teleport_batch(case.model, loss_fn, case.x, case.y, config, holdout=(case.x, case.y))
    assert report.stop_reason == "cap" and report.layers == [] and len(seen) == 2
    assert report.heldout_loss_after == report.heldout_loss_before


def test_by_default_a_batch_is_checked_first_when_the_models_last_was_at_cap() -> None:
    case = families.linear()
    loss_fn, seen = _modes_seen(case.loss_fn)
    at_cap, below = TeleportConfig(cap=1e-12), replace(families.OPEN, steps=1)
    reasons, teleporter = [], Teleporter(case.model, loss_fn)  # the model's at-CAP memory is the teleporter's
    for config in (at_cap, at_cap, below, below, at_cap):
        seen.clear()
        reasons.append(teleporter.teleport(case.x, case.y, config=config).stop_reason)
        reasons.append("recorded" if seen[0] else "checked")  # the first pass: the recorder on or not
    assert reasons == ["cap", "recorded", "cap", "checked", "steps", "checked", "steps", "recorded", "cap", "recorded"]
    seen.clear()
    teleport_batch(case.model, loss_fn, case.x, case.y, at_cap)  # a fresh teleporter remembers nothing
    assert seen[0]
