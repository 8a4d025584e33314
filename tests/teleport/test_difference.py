"""``teleport.hvp: difference``: H·∇L from a forward difference of two gradients, no double backward.

The projection, not the HVP, keeps the loss: the difference path keeps it as exactly as the exact one, on every
model family. Its direction is the exact one's to ~1e-12 in float64 and ~1e-4 in float32 (the GPT-style LM's
float64 direction the reference); the parameters end in their own storage; one host read a step, as before.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
from torch import Tensor, nn

from benchmarks import lm_payoff
from benchmarks.lm_payoff import cosine, directions
from teleport import TeleportConfig, Teleporter, teleport_batch
from teleport.ascent import device as device_module
from teleport.ascent.choose import ascent_mode
from teleport.geometry.capture import trainable
from teleport.hvp import objective as objective_module
from teleport.hvp.difference import ShiftScale, difference_hvp, shift_params, unshift
from teleport.hvp.objective import objective, squared_norm
from tests.teleport.families import CASES, OPEN, Case, lm_loss
from tests.teleport.test_on_device import GUARDS, HOST_OPS, assert_same, both, both_teleporters, mlp, ticks_recorded
from tests.teleport.test_uses import assert_exact

DIFF = replace(OPEN, hvp="difference")


def shift_scale(teleporter: Teleporter, like: Tensor) -> ShiftScale:
    """The teleporter's ``ShiftScale`` on ``like``'s device (what its model's next difference starts from); a fresh
    one where it has none there."""
    scale = teleporter.shift
    return scale if scale is not None and scale.now.device == like.device else ShiftScale(like.device)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_family_keeps_its_loss_and_takes_the_exact_paths_steps(name: str) -> None:
    exact, diff = CASES[name](), CASES[name]()
    a = teleport_batch(exact.model, exact.loss_fn, exact.x, exact.y, OPEN)
    b = teleport_batch(diff.model, diff.loss_fn, diff.x, diff.y, DIFF)
    assert (b.steps, b.backoffs, b.stop_reason, b.hvp, a.hvp) == (a.steps, a.backoffs, a.stop_reason, "difference",
                                                                  "exact")
    assert abs(b.loss_after - b.loss_before) <= 1e-9 * abs(b.loss_before)
    assert b.grad_norm_sq_after == pytest.approx(a.grad_norm_sq_after, rel=1e-6)
    start = CASES[name]().model  # seeded: the weights both began from
    with torch.no_grad():
        off = squared_norm([p - q for p, q in zip(diff.model.parameters(), exact.model.parameters(), strict=True)])
        moved = squared_norm([q - s for q, s in zip(exact.model.parameters(), start.parameters(), strict=True)])
    assert math.sqrt(float(off / moved)) < 1e-6  # the move is the exact one's to 1e-6 (measured 2e-8 to 8e-8)


@pytest.mark.usefixtures("float64")
def test_the_families_move_what_they_must_and_keep_the_untouched() -> None:
    for name in ("tied_lm", "transformer-decoder-batch_first=True", "conv-conv2d_depthwise", "shared_and_loop"):
        assert_exact(CASES[name](), DIFF)


class GPT(nn.Module):
    """A small pre-norm GPT: tokens -> logits, a causal mask, the embedding tied to the head."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(64, d), nn.Embedding(32, d)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, activation="gelu",
                                                                batch_first=True, norm_first=True)
                                     for _ in range(2)])

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        h = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return nn.functional.linear(h, self.wte.weight)


def test_a_gpts_direction_is_the_exact_ones_in_float64_and_within_1e_4_in_float32() -> None:
    torch.manual_seed(0)
    model, x = GPT(), torch.randint(0, 64, (2, 32))  # 64 token columns at d = 64: every projection has room
    ref, diff64 = directions(copy.deepcopy(model).double(), lm_loss, x)
    assert 1 - cosine(ref, diff64) < 1e-10
    exact32, diff32 = directions(model, lm_loss, x)
    assert 1 - cosine(exact32, ref) < 1e-6  # the exact float32 direction, against float64
    assert 1 - cosine(diff32, ref) < 1e-4


def test_a_sharpened_lms_shift_is_cut_until_the_direction_is_the_exact_ones_again() -> None:
    """Teleports sharpen a model (‖∇L‖² ×9,000 here in one teleport of 3 steps): the shift that suits the fresh LM
    is then too long for a forward difference (float32: cosine 0.984 to the exact direction; −0.05 on an H200 after a
    benchmark's teleports). One difference measures how far the gradient moved along it and cuts the next shift:
    0.99999 from the second on. A fresh model's shift is left alone (the families keep s = 1, bit for bit)."""
    torch.manual_seed(0)
    model, x = lm_payoff.GPT(256, 64, 1, 32), torch.randint(0, 256, (2, 32))
    fresh = CASES["tied_lm"]()
    fresh_teleporter = Teleporter(fresh.model, fresh.loss_fn, DIFF)
    fresh_teleporter.teleport(fresh.x, fresh.y)
    assert float(shift_scale(fresh_teleporter, fresh.x).now) == 1.0
    before = objective(model, lm_loss, x, x, list(model.parameters()), graph=False).grad_norm_sq
    sharpen = TeleportConfig(steps=16, rise=3.0, cap=math.inf, cap_ratio=1e4, loss_tol=1e-2)
    teleporter = Teleporter(model, lm_loss, sharpen)
    after = teleporter.teleport(x, x).grad_norm_sq_after
    assert after / before > 1e3
    assert 1 - cosine(*directions(model, lm_loss, x)) > 5e-3  # the fresh LM's shift
    scale = shift_scale(teleporter, x)
    first = cosine(*directions(model, lm_loss, x, scale))
    assert float(scale.now) == 1.0 and float(scale.proposed) < 0.5  # kept once its direction starts a step
    scale.commit()
    second = cosine(*directions(model, lm_loss, x, scale))
    assert 1 - first > 5e-3 and 1 - second < 1e-4


def test_the_parameters_end_in_their_own_storage_with_one_host_read_a_step() -> None:
    torch.manual_seed(0)
    model, x = GPT(), torch.randint(0, 64, (2, 32))
    ptrs = [p.data_ptr() for p in model.parameters()]
    teleporter = Teleporter(model, lm_loss, DIFF)

    def reads(steps: int) -> int:
        before = teleporter.reads.count
        report = teleporter.teleport(x, x, config=replace(DIFF, steps=steps, lr=1e-3, loss_tol=1e9))
        assert report.steps == steps and report.backoffs == 0
        return teleporter.reads.count - before

    assert reads(8) - reads(4) == 4
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_the_shift_is_undone_bit_for_bit_and_the_hvp_reads_nothing_on_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = GPT(), torch.randint(0, 64, (2, 32))
    names, params = trainable(model)
    before = [p.detach().clone() for p in params]
    ptrs = [p.data_ptr() for p in params]
    cur = objective(model, lm_loss, x, x, params, graph=False)
    seen: list[Tensor] = []

    def shifted(along: list[Tensor], eps: Tensor) -> list[Tensor]:
        assert eps.dim() == 0 and eps.device == params[0].device and float(eps) > 0  # a device scalar
        saved = shift_params(params, along, eps)
        seen.append(params[0].detach().clone())
        unshift(params, saved)
        return along

    reads: list[int] = []  # every host read a teleport counts (``host_floats``), counted or not
    for module in (objective_module, device_module):
        real = module.host_floats
        monkeypatch.setattr(module, "host_floats", lambda *a, _f=real, **k: reads.append(1) or _f(*a, **k))
    hvp = difference_hvp(cur, params, params[:2], shifted)
    assert not reads and all(float(h.abs().max()) == 0 for h in hvp)  # ∇L at both points: 0
    assert not torch.equal(seen[0], before[0])
    assert [p.data_ptr() for p in params] == ptrs
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_weights_it_cannot_difference_and_the_ascent_it_runs() -> None:
    torch.manual_seed(0)
    case = CASES["linear"]()
    model = case.model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="teleport.hvp 'difference' needs float32 or float64 weights, the model has "
                                         "bfloat16: use teleport.hvp 'exact'"):
        teleport_batch(model, case.loss_fn, case.x.to(torch.bfloat16), case.y, DIFF)
    cpu = torch.device("cpu")
    assert ascent_mode(replace(DIFF, ascent="device"), cpu, None) == "device"
    assert ascent_mode(replace(DIFF, ascent="cuda_graph"), torch.device("cuda", 0), None) == "cuda_graph"
    with pytest.raises(ValueError, match="teleport.hvp must be one of exact, difference"):
        TeleportConfig(hvp="fd")


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("guard", sorted(GUARDS))
def test_the_device_ticks_take_the_host_guards_difference_steps_on_every_branch(guard: str) -> None:
    a, b, host, other = both(mlp(), replace(GUARDS[guard], hvp="difference"))
    assert (a.ascent, b.ascent, a.hvp, b.hvp) == ("host", "device", "difference", "difference")
    assert_same(a, b, host, other)
    assert a.steps > 0 or a.backoffs > 0


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("name", ["tied_lm", "transformer-decoder-batch_first=True", "conv-conv2d_depthwise",
                                  "shared_and_loop"])
def test_difference_ticks_keep_the_loss_and_read_no_value_on_the_host(name: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA graph cannot hold never runs in a tick, the shifted gradient's included; the move is the host
    guard's."""
    case = CASES[name]()
    with ticks_recorded(monkeypatch) as ticks:
        a, b, host, other = both(case, DIFF)
    assert len(ticks) >= 2 and all(len(t) > 10 for t in ticks)
    found = {op.split(".")[0] for tick in ticks for op in tick} & set(HOST_OPS)
    assert not found, f"a tick ran {found}"
    assert_same(a, b, host, other)
    assert abs(b.loss_after - b.loss_before) <= 1e-9 * abs(b.loss_before)
    assert b.grad_norm_sq_after > b.grad_norm_sq_before


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("device", ["device", "cuda_graph"])  # the CUDA graph's path on the CPU: its ticks, eagerly
def test_the_device_ticks_learn_the_host_guards_shift(device: str) -> None:
    """On a sharpened LM the shift is cut as the steps go, and the device ticks — which compute a U every tick and
    use it only to start a step — learn from the differences the host guard makes: the same steps, weights and s."""
    torch.manual_seed(0)
    model, x = lm_payoff.GPT(256, 64, 1, 32), torch.randint(0, 256, (2, 32))
    sharpen = TeleportConfig(steps=16, rise=3.0, cap=math.inf, cap_ratio=1e4, loss_tol=1e-2)
    teleport_batch(model, lm_loss, x, x, sharpen)
    case = Case(model, x, x, [], lm_loss)
    a, b, host, other = both_teleporters(case, replace(DIFF, steps=6, rise=0.3, cap=math.inf, cap_ratio=4.0), device)
    assert a.steps >= 2 and b.ascent == "device"
    scales = [shift_scale(t, x) for t in (host, other)]
    assert float(scales[0].now) < 0.5 and float(scales[1].now) == pytest.approx(float(scales[0].now), rel=1e-6)
    # ‖∇L‖² ~1e6: the paths' rounding, grown — weights of O(0.1) 9e-9 apart on one CPU, 1.9e-9 with atol 1e-9 too
    # much for an AMD EPYC's (2026-12-03); the teleport moves them by up to 0.14
    assert_same(a, b, host.model, other.model, rtol=1e-6, atol=1e-8)


def test_the_spec_reaches_the_algorithm() -> None:
    from api_schemas.spec_io import build_spec
    from workers.train.build import teleport_config

    spec = build_spec({"teleport": {"hvp": "difference"}})
    assert teleport_config(spec.teleport).hvp == "difference"
    assert teleport_config(build_spec({}).teleport).hvp == "exact"

