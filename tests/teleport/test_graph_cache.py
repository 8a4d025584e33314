"""A captured tick serves later batches (``teleport.ascent.graphs``): the new batch's values reach every tensor it
reads.

A CUDA graph replays its kernels on the tensors it was captured with. Without a GPU the capture is emulated: the
"graph" of a tick is the captured ``DeviceAscent``'s own tick, called again on the same objects — it reads the same
static inputs, state tensors, blocks and bases a replay reads, so a value the cache failed to copy in (a basis, a row
class, the batch) leaves the stale one there and the teleport differs from a fresh one. What only CUDA can show (the
capture itself, addresses in a graph's pool) is ``tests/teleport/test_on_device.py``'s CUDA tests' part.
"""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor

from teleport import Teleporter, teleport_batch, teleporter
from teleport.ascent import graphs
from teleport.ascent.choose import ascent_mode
from teleport.ascent.device import DeviceAscent
from teleport.hvp.objective import objective
from tests.teleport.families import CASES, OPEN, Case
from tests.teleport.test_on_device import assert_same, cuda, mlp

pytestmark = pytest.mark.usefixtures("float64")
GRAPHED = replace(OPEN, steps=3, lr=0.03, ascent="cuda_graph")  # tick 3 captured; later batches replay every tick
# (rtol, atol) of a replayed batch against the eager ticks: a replay is their arithmetic within rounding (exact H·∇L:
# the weights within 5e-12), which the difference H·∇L divides by ε ~ 1e-8 (measured: 1e-9 of O(1) weights, 1.5e-9
# of ‖∇L‖², where a batch of another rank replays)
TOLERANCE = {"exact": (1e-9, 1e-12), "difference": (1e-7, 1e-8)}


def other_batch(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """A batch of the same shapes and other values: floats moved, tokens and labels shifted by one (a bijection
    on their range: a tied LM looks up as many distinct rows, other ones)."""
    def shift(t: Tensor) -> Tensor:
        if t.is_floating_point():
            return t + 0.3 * torch.randn_like(t)
        return torch.where(t >= 0, (t + 1) % (int(t.max()) + 1), t)

    torch.manual_seed(11)
    return shift(x), shift(y)


def fresh_then(case: Case, batches: list[tuple[Tensor, Tensor]], config: Any) -> tuple[Any, Any]:
    """A copy of the model teleported on each batch in turn with ``config`` by one teleporter: (its last report, the
    model)."""
    teleporter = Teleporter(copy.deepcopy(case.model), case.loss_fn, config)
    report = None
    for x, y in batches:
        report = teleporter.teleport(x, y)
    return report, teleporter.model


# each family, and how many captures its three batches need: one — a rank that follows the data (masks from the data)
# keeps the bases' shapes (``blocks.fixed_widths``), a tied LM's looked-up rows are a masked row class
FAMILIES = {"mlp": 1, "transformer-decoder-batch_first=True": 1, "conv-conv2d_depthwise": 1, "shared_and_loop": 1,
            "tied_lm": 1, "attention-cross-batch_first=True-masks=True": 1}


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("hvp", ["exact", "difference"])
def test_a_later_batch_replays_the_captured_tick_and_takes_a_fresh_teleports_steps(
        name: str, hvp: str, captures: list[DeviceAscent]) -> None:
    case = mlp() if name == "mlp" else CASES[name]()
    batches = [(case.x, case.y), other_batch(case.x, case.y), other_batch(*other_batch(case.x, case.y))]
    config = replace(GRAPHED, hvp=hvp)
    graphed, g_model = fresh_then(case, batches, config)
    device, d_model = fresh_then(case, batches, replace(config, ascent="device"))
    assert graphed.ascent == "cuda_graph" and graphed.steps > 0 and graphed.graph_replayed
    assert (graphed.loss_before, graphed.grad_norm_sq_before) == pytest.approx(  # read by its first replayed tick
        (device.loss_before, device.grad_norm_sq_before), rel=1e-12)
    assert_same(device, graphed, d_model, g_model, *TOLERANCE[hvp])
    assert abs(graphed.loss_after - graphed.loss_before) <= 1e-9 * abs(graphed.loss_before)
    assert len(captures) == FAMILIES[name], "a later batch should have replayed an earlier batch's tick"


def test_what_the_graph_depends_on_captures_anew(captures: list[DeviceAscent]) -> None:
    case = mlp()
    model = copy.deepcopy(case.model)
    t = Teleporter(model, case.loss_fn, GRAPHED)
    x2, y2 = other_batch(case.x, case.y)
    first = t.teleport(case.x, case.y)
    second = t.teleport(x2, y2)
    assert len(captures) == 1 and (first.graph_replayed, second.graph_replayed) == (False, True)
    t.teleport(x2[:5], y2[:5])  # another batch shape: new static inputs
    assert len(captures) == 2
    t.teleport(x2, y2, config=replace(GRAPHED, lr=0.05))  # another config
    assert len(captures) == 3
    weight = next(model.parameters())
    weight.data = weight.data.clone()  # a parameter in another storage than the graph reads
    expected, e_model = fresh_then(Case(copy.deepcopy(model), x2, y2, []), [(x2, y2)], replace(GRAPHED, lr=0.05,
                                                                                                ascent="device"))
    report = t.teleport(x2, y2, config=replace(GRAPHED, lr=0.05))
    assert len(captures) == 4
    assert_same(expected, report, e_model, model, rtol=1e-9)


def test_batches_whose_shapes_keep_changing_drop_the_graph_and_auto_takes_the_host_guard(
        captures: list[DeviceAscent]) -> None:
    """An LM's batches padded to their longest sequence: each captures a graph of its own (a warm-up tick, the
    capture, a memory pool) that no later batch replays. The ``CHURN``-th such batch in a row drops the graph, and
    ``auto`` runs the model's later batches by the host guard; a batch that replays starts the count again."""
    case = mlp()
    t, gpu = Teleporter(copy.deepcopy(case.model), case.loss_fn, GRAPHED), torch.device("cuda", 0)
    auto = replace(GRAPHED, ascent="auto")
    x2, y2 = other_batch(case.x, case.y)
    reports = [t.teleport(x, y) for x, y in ((case.x, case.y), (x2, y2))]
    assert [r.graph_replayed for r in reports] == [False, True] and not t.graphs.churning
    for n in range(1, graphs.CHURN + 1):  # a batch one sample shorter each time
        assert ascent_mode(auto, gpu, None, t.graphs) == "cuda_graph"
        t.teleport(case.x[:-n], case.y[:-n])
    assert len(captures) == 1 + graphs.CHURN
    assert t.graphs.churning and t.graphs.entry is None  # its memory pool let go
    assert ascent_mode(auto, gpu, None, t.graphs) == "host"
    other = Teleporter(case.model, case.loss_fn, auto)
    assert ascent_mode(auto, gpu, None, other.graphs) == "cuda_graph"  # another model's count is its own


def test_a_replayed_batch_reads_its_start_in_its_first_tick(captures: list[DeviceAscent],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch the model's graph serves needs no eager gradient: its start is a forward that records the uses
    (the bases' R), and the first replayed tick reads L, ‖∇L‖² and the batch's CAP itself — on a GPU the eager
    evaluation's backward was most of a replayed batch's setup. What it reports is what the host would have read;
    a batch already at CAP stops in that tick."""
    case = mlp()
    model = copy.deepcopy(case.model)
    x2, y2 = other_batch(case.x, case.y)
    eager: list[str] = []
    for name in ("objective", "recorded_loss"):
        real = getattr(teleporter, name)
        monkeypatch.setattr(teleporter, name, lambda *a, _f=real, _n=name, **k: eager.append(_n) or _f(*a, **k))
    own_cap = replace(GRAPHED, cap=math.inf, cap_ratio=1.5)
    t = Teleporter(model, case.loss_fn, own_cap)
    first = t.teleport(case.x, case.y)
    assert eager == ["objective"] and not first.graph_replayed
    eager.clear()
    second = t.teleport(x2, y2)
    assert eager == ["recorded_loss"] and second.graph_replayed and len(captures) == 1  # no eager gradient
    read = objective(model, case.loss_fn, x2, y2, list(model.parameters()), graph=False)
    expected, e_model = fresh_then(Case(copy.deepcopy(model), x2, y2, []), [(x2, y2)], replace(own_cap,
                                                                                            ascent="device"))
    third = t.teleport(x2, y2)
    assert (third.loss_before, third.grad_norm_sq_before) == pytest.approx((read.loss, read.grad_norm_sq), rel=1e-12)
    assert_same(expected, third, e_model, model, rtol=1e-9)
    assert third.grad_norm_sq_after <= 1.5 * third.grad_norm_sq_before  # the batch's own CAP, set on the device
    at_cap = t.teleport(x2, y2, config=replace(own_cap, cap=0.5 * third.grad_norm_sq_after))
    assert (at_cap.steps, at_cap.stop_reason, at_cap.graph_replayed) == (0, "cap", True)
    assert at_cap.grad_norm_sq_before == pytest.approx(third.grad_norm_sq_after, rel=1e-12)
    assert t.at_cap  # as a batch the host found at CAP: the next one checks first


def rank_batches() -> list[Tensor]:
    """Three token batches of the tied LM: one equal column at block 0 (token 3 at position 2 of both sequences), none,
    and two (the same first token, which every block sees alike, and token 3 again)."""
    head = torch.tensor([[1, 2, 3, 4, 5]])
    return [torch.cat([head, torch.tensor([tail])]) for tail in ([5, 4, 3, 2, 1], [5, 4, 0, 2, 1], [1, 4, 3, 2, 5])]


@pytest.mark.parametrize("hvp", ["exact", "difference"])
def test_a_batch_of_another_rank_replays_the_same_graph(hvp: str, captures: list[DeviceAscent]) -> None:
    """An LM's teleport batch loses rank where two sequences hold the same token at the same position (block 0's
    inputs), or the same first token (every block's): the rank differs from batch to batch, the bases' shapes do not
    (``blocks.fixed_widths``), so one capture serves all three, each batch the device ticks' teleport."""
    case = CASES["tied_lm"]()
    config = replace(GRAPHED, hvp=hvp)
    graphed, device = copy.deepcopy(case.model), copy.deepcopy(case.model)
    on_graph = Teleporter(graphed, case.loss_fn, config)
    on_device = Teleporter(device, case.loss_fn, replace(config, ascent="device"))
    ranks = []
    for tokens in rank_batches():
        a = on_device.teleport(tokens, tokens)
        b = on_graph.teleport(tokens, tokens)
        assert b.ascent == "cuda_graph" and b.steps > 0
        assert_same(a, b, device, graphed, *TOLERANCE[hvp])
        assert abs(b.loss_after - b.loss_before) <= 1e-9 * abs(b.loss_before)
        ranks.append(tuple(layer.rank for layer in b.layers))
    assert len(set(ranks)) == 3, ranks  # one equal column, none, two
    assert len(captures) == 1, "a batch of another rank should have replayed the graph"


def test_a_batch_the_budget_shortened_replays_the_same_graph(captures: list[DeviceAscent]) -> None:
    case = mlp()
    x2, y2 = other_batch(case.x, case.y)
    runs = [(case.x, case.y, 3), (x2, y2, 2), (case.x, case.y, 4)]  # the steps a budget left each batch
    graphed, device = copy.deepcopy(case.model), copy.deepcopy(case.model)
    on_graph, on_device = Teleporter(graphed, case.loss_fn, GRAPHED), Teleporter(device, case.loss_fn, GRAPHED)
    for x, y, steps in runs:
        a = on_device.teleport(x, y, config=replace(GRAPHED, steps=steps, ascent="device"))
        b = on_graph.teleport(x, y, config=replace(GRAPHED, steps=steps))
        assert b.steps == steps and b.ascent == "cuda_graph"
        assert_same(a, b, device, graphed, rtol=1e-9)
    assert len(captures) == 1


def test_batches_of_their_own_cap_replay_the_same_graph(captures: list[DeviceAscent]) -> None:
    """``cap_ratio`` gives each batch a CAP of its own (the scale-free setting the hints suggest): a state tensor of the
    tick, not a constant of its capture, so one capture serves them all, each batch the device ticks' teleport."""
    case = mlp()
    x2, y2 = other_batch(case.x, case.y)
    config = replace(GRAPHED, steps=4, rise=0.5, cap_ratio=1.5)  # ×1.5 a batch: the third step passes it
    graphed, device = copy.deepcopy(case.model), copy.deepcopy(case.model)
    on_graph = Teleporter(graphed, case.loss_fn, config)
    on_device = Teleporter(device, case.loss_fn, replace(config, ascent="device"))
    caps = set()
    for x, y in [(case.x, case.y), (x2, y2), (case.x, case.y)]:
        a = on_device.teleport(x, y)
        b = on_graph.teleport(x, y)
        assert b.ascent == "cuda_graph" and b.stop_reason == "cap" and b.steps > 0
        assert b.grad_norm_sq_before < b.grad_norm_sq_after <= 1.5 * b.grad_norm_sq_before
        assert_same(a, b, device, graphed, rtol=1e-9)
        caps.add(round(1.5 * b.grad_norm_sq_before, 9))
    assert len(caps) == 3 and len(captures) == 1, "a batch of another CAP should have replayed the graph"


def test_the_captured_graph_dies_with_its_model(captures: list[DeviceAscent]) -> None:
    """The graph is its model's teleporter's, nothing else's: both gone, it is freed (never kept at module level)."""
    case = mlp()
    model = copy.deepcopy(case.model)
    t = Teleporter(model, case.loss_fn, GRAPHED)
    t.teleport(case.x, case.y)
    assert t.graphs.entry is not None and t.graphs.entry.ascent is captures[0]
    held = [weakref.ref(o) for o in (model, t.graphs.entry, captures[0])]
    captures.clear()
    del model, t
    gc.collect()
    assert all(ref() is None for ref in held)
    other = Teleporter(copy.deepcopy(case.model), case.loss_fn, GRAPHED)
    other.teleport(case.x, case.y)
    other.graphs.release()
    assert other.graphs.entry is None


@cuda
@pytest.mark.parametrize("name", ["mlp", "tied_lm", "transformer-decoder-batch_first=True"])
@pytest.mark.parametrize("hvp", ["exact", "difference"])
@pytest.mark.parametrize("own_cap", [False, True], ids=["cap", "cap_ratio"])
def test_a_cuda_graph_serves_later_batches_on_cuda(name: str, hvp: str, own_cap: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, for real: one capture for three batches, each batch the device ticks' teleport (the tied LM's also
    for three batches of three ranks); a replayed batch's start — L, ‖∇L‖² and, with ``cap_ratio``, its own CAP —
    read by its first replayed tick."""
    with torch.device("cpu"):
        case = mlp() if name == "mlp" else CASES[name]()
        batches = [(case.x, case.y), other_batch(case.x, case.y), other_batch(*other_batch(case.x, case.y))]
    case = Case(case.model.cuda(), case.x.cuda(), case.y.cuda(), case.moved, case.loss_fn)
    batches = [(x.cuda(), y.cuda()) for x, y in batches]
    made, capture = [], DeviceAscent._capture

    def counted(self: DeviceAscent, side: Any, full: bool = True) -> Any:
        if full:
            made.append(self)
        return capture(self, side, full)

    monkeypatch.setattr(DeviceAscent, "_capture", counted)
    config = replace(GRAPHED, hvp=hvp, **({"cap": math.inf, "cap_ratio": 1.5} if own_cap else {}))
    graphed, g_model = fresh_then(case, batches, config)
    device, d_model = fresh_then(case, batches, replace(config, ascent="device"))
    assert graphed.ascent == "cuda_graph" and len(made) == 1, "one capture should have served the three batches"
    assert graphed.graph_replayed and graphed.loss_before == pytest.approx(device.loss_before, rel=1e-9)
    assert graphed.grad_norm_sq_before == pytest.approx(device.grad_norm_sq_before, rel=1e-9)
    assert_same(device, graphed, d_model, g_model, rtol=1e-7, atol=TOLERANCE[hvp][1])
    if name == "tied_lm":  # and three batches of three ranks
        made.clear()
        batches = [(t.cuda(), t.cuda()) for t in rank_batches()]
        graphed, g_model = fresh_then(case, batches, config)
        device, d_model = fresh_then(case, batches, replace(config, ascent="device"))
        assert len(made) == 1, "a batch of another rank should have replayed the graph"
        assert_same(device, graphed, d_model, g_model, rtol=1e-7, atol=TOLERANCE[hvp][1])


def test_the_spec_asks_for_it_and_without_cuda_gets_the_device_ticks() -> None:
    from api_schemas.spec_io import build_spec
    from workers.train.build import teleport_config

    config = teleport_config(build_spec({"teleport": {"ascent": "cuda_graph", "steps": 3}}).teleport)
    assert config.ascent == "cuda_graph"
    case = mlp()
    report = teleport_batch(copy.deepcopy(case.model), case.loss_fn, case.x, case.y,
                            replace(config, lr=OPEN.lr, cap=OPEN.cap, loss_tol=OPEN.loss_tol))
    assert report.ascent == "device" and report.steps == 3


def test_a_model_whose_capture_failed_keeps_no_graph(captures: list[DeviceAscent],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A later capture that fails (for another config, say) drops the model's graph: its next batches are not
    copied into the static inputs, and must not be replayed from it."""
    case = mlp()
    model = copy.deepcopy(case.model)
    t = Teleporter(model, case.loss_fn, GRAPHED)
    t.teleport(case.x, case.y)
    assert t.graphs.entry is not None and t.graphs.entry.ascent is captures[0]
    monkeypatch.setattr(DeviceAscent, "_capture", lambda self, side, full=True: None)  # a capture that fails
    x2, y2 = other_batch(case.x, case.y)
    report = t.teleport(x2, y2, config=replace(GRAPHED, lr=0.05))
    assert report.ascent == "device" and t.graphs.capturing.failed and t.graphs.entry is None
    expected, e_model = fresh_then(Case(copy.deepcopy(model), x2, y2, []), [(x2, y2)], replace(GRAPHED,
                                                                                              ascent="device"))
    report = t.teleport(x2, y2)  # the first graph's key again: eager ticks
    assert report.ascent == "device"
    assert_same(expected, report, e_model, model, rtol=1e-9)


def _accumulators(roots: list[Any]) -> set[int]:
    """The leaf tensors whose AccumulateGrad nodes the autograd graphs of ``roots`` reach, by id (the caller keeps
    them alive: the parameters, a captured teleport's aliases). Every node visited is held until the walk ends: torch
    2.11 makes a node's Python object afresh at each access and frees it after, so ids were reused and the walk
    stopped after two nodes (this test's failure on an H200; 2.13 keeps them)."""
    held: list[Any] = []
    seen: set[int] = set()
    found: set[int] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            held.append(node)
            seen.add(id(node))
            found |= {id(node.variable)} if type(node).__name__ == "AccumulateGrad" else set()
            stack += [n for n, _ in node.next_functions if n is not None]
    return found


@pytest.mark.parametrize("name", ["mlp", "tied_lm"])
def test_a_captured_teleport_differentiates_by_leaves_of_its_own(name: str, captures: list[DeviceAscent],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A training step's graph a loop still holds (its last loss) keeps the parameters' AccumulateGrad nodes alive —
    on CUDA made on the default stream, which a backward captured on a side stream must not reach (the H200's
    failure). A captured teleport's graphs reach none of them; the model keeps its own parameters, moved as the
    device ticks move them, their .grad untouched."""
    case = mlp() if name == "mlp" else CASES[name]()
    model, twin = copy.deepcopy(case.model), copy.deepcopy(case.model)
    loss = case.loss_fn(model(case.x), case.y)
    loss.backward()  # held below, as a training loop holds its last step's loss
    stale, params = _accumulators([loss.grad_fn]), list(model.parameters())
    grads = [p.grad.clone() for p in params]
    reached: set[int] = set()
    grad = torch.autograd.grad

    def spy(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        roots = outputs if isinstance(outputs, list | tuple) else [outputs]
        reached.update(_accumulators([o.grad_fn for o in roots]))
        return grad(outputs, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    x2, y2 = other_batch(case.x, case.y)
    t = Teleporter(model, case.loss_fn, GRAPHED)
    reports = [t.teleport(x, y) for x, y in ((case.x, case.y), (x2, y2))]
    monkeypatch.setattr(torch.autograd, "grad", grad)
    assert stale, "the training step's graph reaches no parameter"
    assert reached, "no graph of the captured teleport reached a leaf"
    assert not reached & stale, "a captured teleport reached a training step's leaf nodes"
    assert [r.graph_replayed for r in reports] == [False, True] and len(captures) == 1
    assert all(p is q for p, q in zip(params, model.parameters(), strict=True))
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    expected, e_model = fresh_then(Case(twin, case.x, case.y, [], case.loss_fn), [(case.x, case.y), (x2, y2)],
                                   replace(GRAPHED, ascent="device"))
    assert_same(expected, reports[-1], e_model, model, rtol=1e-9)
    del loss


@cuda
@pytest.mark.parametrize("hvp", ["exact", "difference"])
def test_a_cuda_graph_captures_while_a_training_steps_graph_is_held(hvp: str) -> None:
    """On a GPU, for real: a loop's last loss held on the default stream does not fail the capture."""
    with torch.device("cpu"):
        case = mlp()
    model, x, y = case.model.cuda(), case.x.cuda(), case.y.cuda()
    loss = case.loss_fn(model(x), y)
    loss.backward()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = teleport_batch(model, case.loss_fn, x, y, replace(GRAPHED, hvp=hvp))
    troubles = [str(w.message) for w in seen if "captured" in str(w.message) or "AccumulateGrad" in str(w.message)]
    assert report.ascent == "cuda_graph" and report.steps > 0 and not troubles, troubles
    del loss
