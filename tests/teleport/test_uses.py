"""Exact teleport on the layers real models are built of: every use of a parameter constrains it.

Each case (``tests/teleport/families.py``): float64, τ = 1, a loss tolerance so loose the guard hides
nothing; the batch loss must stay within 1e-9 (relative) while the listed parameters actually move.
"""

from __future__ import annotations

import pytest
import torch

from teleport import TeleportConfig, teleport_batch
from tests.teleport import families
from tests.teleport.families import OPEN, Case

pytestmark = pytest.mark.usefixtures("float64")


def assert_exact(case: Case, config: TeleportConfig = OPEN) -> dict[str, str]:
    """Teleport; the loss is kept to 1e-9 and every name in ``case.moved`` changed. Returns report.untouched."""
    model, x, y, loss_fn = case.model, case.x, case.y, case.loss_fn
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = teleport_batch(model, loss_fn, x, y, config)
    assert report.steps > 0, report
    assert report.grad_norm_sq_after > report.grad_norm_sq_before
    with torch.no_grad():
        loss = float(loss_fn(model(x), y))
    for value in (report.loss_after, loss):
        assert abs(value - report.loss_before) <= 1e-9 * abs(report.loss_before)
    params = dict(model.named_parameters())
    for name in case.moved:
        assert (params[name] - before[name]).norm() > 0, f"{name} did not move"
    for name in report.untouched:
        assert torch.equal(params[name], before[name]), f"{name} is reported untouched but moved"
    return report.untouched


@pytest.mark.parametrize("case", sorted(families.CONVS))
def test_convolutions_of_every_kind_move_exactly(case: str) -> None:
    assert_exact(families.conv(case))


def test_linear_layers_move_exactly_and_the_report_names_them() -> None:
    assert assert_exact(families.linear()) == {}


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("masks", [False, True], ids=["nomask", "masks"])
def test_multihead_attention_moves_its_packed_projections_exactly(cross: bool, batch_first: bool,
                                                                  masks: bool) -> None:
    assert_exact(families.attention(cross, batch_first, masks))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_transformer_layers_move_exactly_and_norms_stay(batch_first: bool, decoder: bool) -> None:
    untouched = assert_exact(families.transformer(batch_first, decoder))
    assert untouched["layer.norm1.weight"] == "used by layer_norm (not a linear map)"


@pytest.mark.parametrize("kind", ["conv1d_gpt2", "raw_f_linear"])
def test_functional_linear_maps_on_raw_parameters_move_exactly(kind: str) -> None:
    assert assert_exact(families.functional(kind)) == {}  # the head is a raw x @ Wᵀ in both


def test_tied_embedding_and_lm_head_move_exactly_and_looked_up_rows_stay() -> None:
    case = families.tiny_lm()
    table = case.model.wte.weight.detach().clone()
    assert_exact(case)
    looked_up = torch.unique(case.x)
    others = torch.tensor([i for i in range(20) if i not in looked_up.tolist()])
    assert torch.equal(case.model.wte.weight[looked_up], table[looked_up])
    assert (case.model.wte.weight[others] - table[others]).norm() > 0


def test_a_llama_moves_its_projections_and_swiglu_exactly_and_leaves_its_norms() -> None:
    # RMSNorm, rotary positions, grouped-query attention through scaled_dot_product_attention, SwiGLU, untied head
    untouched = assert_exact(families.llama())
    assert untouched["blocks.0.norm1.weight"] == "used by rms_norm (not a linear map)"
    assert untouched["embed.weight"].startswith("only looked up")
    assert set(untouched) == {"embed.weight", "norm.weight"} | {f"blocks.{i}.norm{j}.weight" for i in (0, 1)
                                                                for j in (1, 2)}


def test_shared_weights_and_a_linear_in_a_loop_move_exactly() -> None:
    untouched = assert_exact(families.shared())
    assert set(untouched) == {"b.bias"} and "a.weight" in untouched["b.bias"]


def test_untouched_parameters_say_why_and_stay_exactly() -> None:
    untouched = assert_exact(families.odd())
    assert untouched["pos"] == "used by add (not a linear map)"
    assert untouched["norm.weight"] == "used by layer_norm (not a linear map)"
    assert untouched["wn.parametrizations.weight.original0"].startswith("used by _weight_norm")
    assert "not a trainable parameter" in untouched["wn.bias"]  # its weight cannot move: nor may it alone
