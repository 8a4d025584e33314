"""The tick that only judges a try (``DeviceAscent._judge``) and the capture of a batch of two ticks.

A try aimed at CAP, or shortened to fit under it, or of the last step, ends the batch when accepted and is tried
again along the same U when not: the tick judging it needs no U, no double backward. Next to a captured full tick it
has a graph of its own. The CPU emulates the captures (``conftest.captures``); the CUDA test captures for real.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from teleport import Teleporter
from teleport.ascent.device import DeviceAscent
from tests.teleport.families import CASES, Case
from tests.teleport.test_graph_cache import GRAPHED, TOLERANCE, other_batch
from tests.teleport.test_on_device import assert_same, cuda, mlp

pytestmark = pytest.mark.usefixtures("float64")
SCALE_FREE = replace(GRAPHED, steps=8, cap=math.inf, rise=1.5, cap_ratio=2.0)  # step 1 aimed at CAP, every batch
TWO_TICKS = replace(GRAPHED, steps=8, cap=math.inf, rise=0.5, cap_ratio=1.2)  # the MLP's lands at ×1.19, no back-off


def test_a_scale_free_batch_replays_one_full_tick_and_one_judging_tick(captures: list[DeviceAscent]) -> None:
    """Step 1 of a scale-free batch is aimed at CAP (``aim.aims_first``): the tick that judges it needs no U, so it
    has a graph of its own (``DeviceAscent._judge``: eager on the batch that warms it up, captured on the next),
    and a replayed batch runs the full tick's graph once. Each batch is the device ticks' teleport."""
    case = mlp()
    config = SCALE_FREE
    batches = [(case.x, case.y), other_batch(case.x, case.y), other_batch(*other_batch(case.x, case.y))]
    graphed = Teleporter(copy.deepcopy(case.model), case.loss_fn, config)
    device = Teleporter(copy.deepcopy(case.model), case.loss_fn, replace(config, ascent="device"))

    def replayed() -> tuple[int, int]:  # (full, judging) ticks replayed so far from the model's graphs
        ascent = captures[0] if captures else None
        return tuple(g.replays if g is not None else 0 for g in (ascent and ascent.graph, ascent and ascent.judge))

    judges, replays = [], []
    for x, y in batches * 2:
        a = device.teleport(x, y)
        before = replayed()
        b = graphed.teleport(x, y)
        assert b.ascent == "cuda_graph" and b.stop_reason == "cap" and b.steps == 1
        assert_same(a, b, device.model, graphed.model, rtol=1e-9)
        assert graphed.graphs.entry is not None and graphed.graphs.entry.ascent is not None
        judges.append(graphed.graphs.entry.ascent.judge)
        replays.append((*(n - m for n, m in zip(replayed(), before, strict=True)), b.backoffs))
    assert len(captures) == 1 and all(j is not None and not j.full for j in judges[2:])
    assert len({id(j) for j in judges[2:]}) == 1, "one judging tick's graph should serve the later batches"
    assert all(full == 1 and judged == 1 + backoffs for full, judged, backoffs in replays[3:]), replays


def test_batches_of_two_ticks_are_captured_after_one_warm_up(captures: list[DeviceAscent]) -> None:
    """A batch that lands its aimed step at the first try has two ticks: the start's and the one judging it. The
    model's first such batch runs the full tick once eagerly (the capture's warm-up); the next captures it at its
    second tick, and the later ones replay it (it never was captured when the warm-up was each batch's own)."""
    case = mlp()
    config = TWO_TICKS
    x2, y2 = other_batch(case.x, case.y)
    graphed = Teleporter(copy.deepcopy(case.model), case.loss_fn, config)
    device = Teleporter(copy.deepcopy(case.model), case.loss_fn, replace(config, ascent="device"))
    reports = []
    for x, y in [(case.x, case.y), (x2, y2)] * 2:
        a = device.teleport(x, y)
        reports.append(b := graphed.teleport(x, y))
        assert (b.steps, b.backoffs, b.stop_reason) == (1, 0, "cap")
        assert_same(a, b, device.model, graphed.model, rtol=1e-9)
    assert len(captures) == 1 and [r.graph_replayed for r in reports] == [False, False, True, True]


def test_batches_of_one_step_are_captured_too(captures: list[DeviceAscent]) -> None:
    """A batch of one step (``teleport.steps`` 1, or the budget's shortening) has only ticks that judge the last
    step's tries; they warm the full tick up and capture it all the same, so later batches replay it from their
    start (they ran eagerly, each with its eager double backward, before)."""
    case = mlp()
    config = replace(GRAPHED, steps=1)
    x2, y2 = other_batch(case.x, case.y)
    graphed = Teleporter(copy.deepcopy(case.model), case.loss_fn, config)
    device = Teleporter(copy.deepcopy(case.model), case.loss_fn, replace(config, ascent="device"))
    reports = []
    for x, y in [(case.x, case.y), (x2, y2)] * 2:
        a = device.teleport(x, y)
        reports.append(b := graphed.teleport(x, y))
        assert b.steps == 1
        assert_same(a, b, device.model, graphed.model, rtol=1e-9)
    assert len(captures) == 1 and [r.graph_replayed for r in reports] == [False, False, True, True]
    assert [r.ascent for r in reports] == ["device"] + ["cuda_graph"] * 3  # the first: the warm-up, eager


def test_a_judging_tick_that_cannot_be_captured_stays_eager(captures: list[DeviceAscent],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A judging tick whose capture fails runs eagerly from then on, the full tick's graph kept and replayed: every
    batch still the device ticks' teleport."""
    emulated = DeviceAscent._capture  # the fixture's emulated capture

    def no_judge(self: DeviceAscent, side: Any, full: bool = True) -> Any:
        return emulated(self, side, full) if full else None

    monkeypatch.setattr(DeviceAscent, "_capture", no_judge)
    case = mlp()
    graphed = Teleporter(copy.deepcopy(case.model), case.loss_fn, SCALE_FREE)
    device = Teleporter(copy.deepcopy(case.model), case.loss_fn, replace(SCALE_FREE, ascent="device"))
    for x, y in [(case.x, case.y), other_batch(case.x, case.y)] * 2:
        a = device.teleport(x, y)
        b = graphed.teleport(x, y)
        assert_same(a, b, device.model, graphed.model, rtol=1e-9)
    assert graphed.graphs.entry is not None
    ascent = graphed.graphs.entry.ascent
    assert (ascent.judge, ascent.judging, b.graph_replayed, len(captures)) == (None, "eager", True, 1)


@cuda
@pytest.mark.parametrize("name", ["mlp", "tied_lm"])
@pytest.mark.parametrize("hvp", ["exact", "difference"])
@pytest.mark.parametrize("config", ["scale_free", "two_ticks"])
def test_a_cuda_graph_judges_with_a_graph_of_its_own_on_cuda(name: str, hvp: str, config: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, for real: a scale-free model's batches replay one captured full tick and one captured judging tick,
    a model of two-tick batches is captured on its second batch, and every batch is the device ticks' teleport."""
    with torch.device("cpu"):
        case = mlp() if name == "mlp" else CASES[name]()
        batches = [(case.x, case.y), other_batch(case.x, case.y), other_batch(*other_batch(case.x, case.y))]
    case = Case(case.model.cuda(), case.x.cuda(), case.y.cuda(), case.moved, case.loss_fn)
    made, capture = [], DeviceAscent._capture

    def counted(self: DeviceAscent, side: Any, full: bool = True) -> Any:
        graph = capture(self, side, full)
        made.append((full, graph is not None))
        return graph

    monkeypatch.setattr(DeviceAscent, "_capture", counted)
    chosen = replace(SCALE_FREE if config == "scale_free" else TWO_TICKS, hvp=hvp)
    graphed = Teleporter(copy.deepcopy(case.model), case.loss_fn, chosen)
    device = Teleporter(copy.deepcopy(case.model), case.loss_fn, replace(chosen, ascent="device"))
    reports = []
    for x, y in [(x.cuda(), y.cuda()) for x, y in batches] * 2:
        a = device.teleport(x, y)
        reports.append(b := graphed.teleport(x, y))
        assert_same(a, b, device.model, graphed.model, rtol=1e-7, atol=TOLERANCE[hvp][1])
    assert all(ok for _, ok in made) and [full for full, _ in made].count(True) == 1, made
    assert reports[-1].ascent == "cuda_graph" and all(r.graph_replayed for r in reports[2:])
    assert graphed.graphs.entry is not None and graphed.graphs.entry.ascent is not None
    assert isinstance(graphed.graphs.entry.ascent.judge, torch.cuda.CUDAGraph)  # step 1 aimed, each batch
