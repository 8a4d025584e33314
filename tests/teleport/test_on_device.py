"""The ascent decided on the device (``teleport.ascent.device``) takes the host guard's steps, reads nothing between
kernels, and on CUDA replays them from a CUDA graph with the same result.

On the CPU the ticks run eagerly (``ascent="device"``): that is also the fallback when a CUDA capture fails.
The CUDA tests skip without a GPU (``benchmarks/gpu_checks.sh`` runs them on one).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from teleport import TeleportConfig, Teleporter, TeleportReport, teleport_batch
from teleport.ascent.choose import ascent_mode
from teleport.ascent.device import DeviceAscent
from teleport.ascent.graphs import GraphCache
from tests.teleport.families import CASES, OPEN, Case, drawn_on_cpu

pytestmark = pytest.mark.usefixtures("float64")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# guard configs that exercise every branch: open, CAP reached by aiming, CAP overshoot shortened by the
# secant, loss_tol back-offs until every try failed, tries halved until one is accepted, τ < 1 (the
# projected, not the factored, direction)
GUARDS = {
    "open": OPEN,
    "aimed_at_cap": replace(OPEN, steps=6, lr=0.3, cap=0.6),
    "overshoot": replace(OPEN, steps=4, lr=50.0),
    "loss_tol": replace(OPEN, steps=4, lr=0.5, tau=0.5, tau_rule="energy", loss_tol=1e-6, max_backoff=2),
    "halved": replace(OPEN, steps=4, lr=0.05, tau=0.8, loss_tol=1e-4, max_backoff=3),
    "energy_tau": replace(OPEN, steps=3, tau=0.9, tau_rule="energy"),
    "scale_free": replace(OPEN, steps=4, cap=float("inf"), rise=1.5, cap_ratio=2.0),  # step 1 always aimed
}
# ops that read a tensor's value on the host or give a shape only its values decide: none may run in a tick
HOST_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero", "equal", "lift_fresh")


def _mlp() -> Case:
    torch.manual_seed(0)  # 8 samples < 13 inputs of the first layer: it has free directions
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    return Case(model, torch.randn(8, 12), torch.randint(0, 3, (8,)), [])


def mlp() -> Case:
    """The MLP the guard configs were tuned on, the same on every test device."""
    return drawn_on_cpu(_mlp)


class RowSlices(nn.Module):
    """Rows of one weight in two uses, the bias added to the first half only (a block with ``bias_rows``)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.head = nn.Linear(6, 6), nn.Linear(8, 3)
        self.w, self.b = nn.Parameter(torch.randn(8, 6) * 0.3), nn.Parameter(torch.randn(4) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.pre(x))
        return self.head(torch.tanh(torch.cat([F.linear(h, self.w[:4], self.b), F.linear(h * h, self.w[4:])], -1)))


def row_slices() -> Case:
    torch.manual_seed(0)
    return Case(RowSlices(), torch.randn(3, 6), torch.randint(0, 3, (3,)), ["w"])


def both(case: Case, config: TeleportConfig, device: str = "device") -> tuple[TeleportReport, TeleportReport,
                                                                              nn.Module, nn.Module]:
    """The host guard's and ``device``'s teleport of copies of one model."""
    a, b, host, other = both_teleporters(case, config, device)
    return a, b, host.model, other.model


def both_teleporters(case: Case, config: TeleportConfig, device: str = "device") -> tuple[
        TeleportReport, TeleportReport, Teleporter, Teleporter]:
    """``both``, with the teleporters of the two copies (what each learned, to teleport them again)."""
    host = Teleporter(copy.deepcopy(case.model), case.loss_fn, replace(config, ascent="host"))
    other = Teleporter(copy.deepcopy(case.model), case.loss_fn, replace(config, ascent=device))
    return host.teleport(case.x, case.y), other.teleport(case.x, case.y), host, other


def assert_same(a: TeleportReport, b: TeleportReport, host: nn.Module, other: nn.Module, rtol: float = 1e-9,
                atol: float = 1e-12) -> None:
    assert (b.steps, b.backoffs, b.stop_reason) == (a.steps, a.backoffs, a.stop_reason)
    assert b.loss_after == pytest.approx(a.loss_after, rel=rtol, abs=1e-12)
    assert b.grad_norm_sq_after == pytest.approx(a.grad_norm_sq_after, rel=rtol)
    for (name, p), q in zip(host.named_parameters(), other.parameters(), strict=True):
        assert torch.allclose(p, q.to(p.device), rtol=rtol, atol=atol), f"{name} differs"


@pytest.mark.parametrize("guard", sorted(GUARDS))
def test_the_device_ticks_take_the_host_guards_steps_on_every_branch(guard: str) -> None:
    a, b, host, other = both(mlp(), GUARDS[guard])
    assert (a.ascent, b.ascent) == ("host", "device")
    assert_same(a, b, host, other)
    assert a.steps > 0 or a.backoffs > 0
    assert b.loss_after == pytest.approx(b.loss_before, rel=GUARDS[guard].loss_tol)


def test_the_guard_configs_reach_the_branches_they_are_named_for() -> None:
    reports = {name: both(mlp(), config)[1] for name, config in GUARDS.items()}
    assert reports["open"].stop_reason == "steps"
    assert reports["aimed_at_cap"].stop_reason == "cap" and reports["aimed_at_cap"].backoffs == 0
    assert reports["overshoot"].stop_reason == "cap" and reports["overshoot"].backoffs > 0
    assert reports["loss_tol"].stop_reason == "loss_tol" and reports["loss_tol"].backoffs == 3
    assert reports["halved"].stop_reason == "steps" and reports["halved"].backoffs > 0
    assert reports["scale_free"].stop_reason == "cap" and reports["scale_free"].steps == 1


@pytest.mark.parametrize("name", [*sorted(CASES), "row_slices"])
def test_every_model_family_takes_the_same_exact_steps_on_the_device(name: str) -> None:
    a, b, host, other = both(row_slices() if name == "row_slices" else CASES[name](), OPEN)
    assert_same(a, b, host, other)
    assert abs(b.loss_after - b.loss_before) <= 1e-9 * abs(b.loss_before)
    assert b.grad_norm_sq_after > b.grad_norm_sq_before


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@contextmanager
def ticks_recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """Every tick's aten ops, one list per tick."""
    ticks: list[list[str]] = []
    tick = DeviceAscent.tick

    def recorded(self: DeviceAscent, full: bool, given: Any = None) -> None:
        with _Ops() as ops:
            tick(self, full, given)
        ticks.append(ops.seen)

    monkeypatch.setattr(DeviceAscent, "tick", recorded)
    yield ticks


@pytest.mark.parametrize("name", ["tied_lm", "transformer-decoder-batch_first=True", "conv-conv2d_depthwise",
                                  "shared_and_loop", "row_slices"])
def test_a_tick_reads_no_value_on_the_host(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA graph cannot hold — a value read on the host, a shape only the values decide — never runs."""
    case = row_slices() if name == "row_slices" else CASES[name]()
    for guard in (OPEN, GUARDS["overshoot"]):
        with ticks_recorded(monkeypatch) as ticks:
            teleport_batch(copy.deepcopy(case.model), case.loss_fn, case.x, case.y, replace(guard, ascent="device"))
        assert len(ticks) >= 2 and all(len(t) > 10 for t in ticks)
        found = {op.split(".")[0] for tick in ticks for op in tick} & set(HOST_OPS)
        assert not found, f"a tick ran {found}"


@pytest.mark.parametrize("guard", ["scale_free", "aimed_at_cap", "overshoot", "open"])
def test_a_tick_no_step_can_follow_computes_no_direction(guard: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tick judging a try aimed at CAP, shortened to fit under it, or of the last step evaluates without the
    double backward (``full=False``): a scale-free batch is one full tick and one judging one, and every batch takes
    the host guard's steps (``test_the_device_ticks_take_the_host_guards_steps_on_every_branch``)."""
    fulls: list[bool] = []
    tick = DeviceAscent.tick

    def recorded(self: DeviceAscent, full: bool, given: Any = None) -> None:
        fulls.append(full)
        tick(self, full, given)

    monkeypatch.setattr(DeviceAscent, "tick", recorded)
    config = replace(GUARDS[guard], ascent="device")
    case = mlp()
    report = teleport_batch(copy.deepcopy(case.model), case.loss_fn, case.x, case.y, config)
    assert len(fulls) == 1 + report.steps + report.backoffs  # the start's, then one a try
    if guard == "scale_free":  # step 1 aimed (its first try shortened on this MLP: no aim learned yet)
        assert fulls == [True] + [False] * (1 + report.backoffs) and report.steps == 1
    elif guard == "open":  # nothing aimed: full ticks but the last step's judging one
        assert fulls == [True] * config.steps + [False]
    else:  # a full tick after the start's only where the try it judged was neither aimed nor shortened
        assert fulls[-1] is False and fulls.count(True) <= 1 + report.steps


def test_one_host_read_per_step() -> None:
    case = mlp()

    def reads(steps: int) -> int:
        teleporter = Teleporter(copy.deepcopy(case.model), case.loss_fn, replace(OPEN, steps=steps, ascent="device"))
        report = teleporter.teleport(case.x, case.y)
        assert report.steps == steps and report.backoffs == 0
        return teleporter.reads.count

    assert reads(8) - reads(4) == 4
    assert reads(1) == reads(0) + 1  # the evaluation at the start is the host guard's: the first tick reads nothing


def test_a_tick_that_raises_leaves_the_last_accepted_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    case, config = mlp(), replace(OPEN, steps=2, ascent="device")
    expected = copy.deepcopy(case.model)
    teleport_batch(expected, case.loss_fn, case.x, case.y, replace(config, steps=1))  # where step 1 ends
    tick, calls = DeviceAscent.tick, [0]

    def failing(self: DeviceAscent, full: bool, given: Any = None) -> None:
        calls[0] += 1
        if calls[0] == 3:  # tick 2 accepted step 1 and moved to step 2's try: tick 3 would judge it
            raise RuntimeError("out of memory (simulated)")
        tick(self, full, given)

    monkeypatch.setattr(DeviceAscent, "tick", failing)
    model = copy.deepcopy(case.model)
    with pytest.raises(RuntimeError, match="simulated"):
        teleport_batch(model, case.loss_fn, case.x, case.y, config)
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-14)


def test_auto_is_the_cuda_graph_on_cuda_and_the_host_guard_elsewhere() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    ranks = SimpleNamespace(rank=0, world_size=2)  # ascent_mode reads only the world size
    model, stubborn = GraphCache(), GraphCache()  # the graph caches of two models' teleporters
    stubborn.capturing.failed = True
    assert ascent_mode(OPEN, gpu, None) == ascent_mode(OPEN, gpu, None, model) == "cuda_graph"  # H200: 3.3x faster
    assert ascent_mode(OPEN, cpu, None, model) == "host"  # the faster on the CPU
    assert ascent_mode(OPEN, gpu, None, stubborn) == "host"  # no graph holds its tick: the faster eager ascent
    assert ascent_mode(replace(OPEN, ascent="cuda_graph"), gpu, None, stubborn) == "cuda_graph"  # asked: the ticks
    assert ascent_mode(replace(OPEN, ascent="cuda_graph"), cpu, None) == "device"  # no CUDA: the same ticks, eagerly
    assert ascent_mode(OPEN, gpu, ranks) == ascent_mode(replace(OPEN, ascent="device"), gpu, ranks) == "host"
    with pytest.raises(ValueError, match="teleport.ascent must be one of"):
        TeleportConfig(ascent="graph")


@cuda
@pytest.mark.parametrize("name", ["tied_lm", "transformer-decoder-batch_first=True", "conv-conv2d_depthwise",
                                  "linear"])
@pytest.mark.parametrize("guard", ["open", "overshoot", "halved"])
@pytest.mark.parametrize("hvp", ["exact", "difference"])
def test_a_cuda_graph_replays_the_device_ticks(name: str, guard: str, hvp: str) -> None:
    with torch.device("cpu"):
        case = CASES[name]()
    case = Case(case.model.cuda(), case.x.cuda(), case.y.cuda(), case.moved, case.loss_fn)
    config = replace(GUARDS[guard], steps=max(GUARDS[guard].steps, 6), hvp=hvp)  # ticks past the warm-up replayed
    host, graphed, h_model, g_model = both(case, config, device="cuda_graph")  # the host guard against the graph
    assert graphed.ascent == "cuda_graph", "the tick was not captured"
    assert_same(host, graphed, h_model, g_model, rtol=1e-7)
    with warnings.catch_warnings(record=True) as caught:  # training goes on on the default stream, unwarned
        warnings.simplefilter("always")
        case.loss_fn(g_model(case.x), case.y).backward()
    assert not [str(w.message) for w in caught if "stream" in str(w.message)]


class _ReadsOnTheHost(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        if float(h.abs().max()) > 1e6:  # a host read in the forward: no CUDA graph can hold it
            h = h / 2
        return self.b(h)


@cuda
def test_a_forward_that_cannot_be_captured_runs_eagerly_with_a_warning() -> None:
    torch.manual_seed(0)
    case = Case(_ReadsOnTheHost().cuda(), torch.randn(4, 6, device="cuda"), torch.randint(0, 3, (4,), device="cuda"),
                [])
    config = replace(OPEN, steps=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, b, host, other = both_teleporters(case, config, device="cuda_graph")
    assert b.ascent == "device" and any("CUDA graph" in str(w.message) for w in caught)
    assert_same(a, b, host.model, other.model, rtol=1e-7)
    assert torch.randn(3, device="cuda").isfinite().all()  # the failed capture gave the CUDA generator back
    with warnings.catch_warnings(record=True) as again:  # the same model's next teleport does not try again
        warnings.simplefilter("always")
        report = other.teleport(case.x, case.y, config=replace(config, ascent="cuda_graph"))
    assert report.ascent == "device" and not any("CUDA graph" in str(w.message) for w in again)
