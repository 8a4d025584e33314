"""Exact teleport on the layers real models are built of: every use of a parameter constrains it.

Each case: float64, τ = 1, a loss tolerance so loose the guard hides nothing; the batch loss must
stay within 1e-9 (relative) while the listed parameters actually move.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from teleport import TeleportConfig, teleport_batch

OPEN = TeleportConfig(steps=3, lr=0.1, cap=1e9, tau=1.0, loss_tol=1.0)  # nothing is backed off for drift

pytestmark = pytest.mark.usefixtures("float64")


def assert_exact(model: nn.Module, x: Tensor, y: Tensor, moved: list[str],
                 loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy) -> dict[str, str]:
    """Teleport; the loss is kept to 1e-9 and every name in ``moved`` changed. Returns report.untouched."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = teleport_batch(model, loss_fn, x, y, OPEN)
    assert report.steps > 0, report
    assert report.grad_norm_sq_after > report.grad_norm_sq_before
    with torch.no_grad():
        loss = float(loss_fn(model(x), y))
    for value in (report.loss_after, loss):
        assert abs(value - report.loss_before) <= 1e-9 * abs(report.loss_before)
    params = dict(model.named_parameters())
    for name in moved:
        assert (params[name] - before[name]).norm() > 0, f"{name} did not move"
    for name in report.untouched:
        assert torch.equal(params[name], before[name]), f"{name} is reported untouched but moved"
    return report.untouched


class Head(nn.Module):
    """x -> tanh(pre(x)) -> body -> tanh -> mean over all but the batch -> a Linear head."""

    def __init__(self, body: nn.Module, c_in: int, c_body: int, classes: int = 3, channels_last: bool = False):
        super().__init__()
        # a 1×1 conv (a Linear) in front: a layer reading the data itself cannot move at τ = 1, its
        # teleport gradient lies in the span of its inputs (see teleport.nullspace._Run._can_move)
        self.pre = type(body)(c_in, c_in, 1) if isinstance(body, nn.modules.conv._ConvNd) else nn.Linear(c_in, c_in)
        self.body, self.channels_last = body, channels_last
        self.head = nn.Linear(c_body, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.body(torch.tanh(self.pre(x))))
        h = h.flatten(2).mean(-1) if not self.channels_last else h.mean(1)
        return self.head(h)


CONVS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {  # built under float64
    "conv1d_grouped_strided_dilated_padded": (lambda: nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=2,
                                                                groups=2), (1, 4, 5)),
    "conv2d_depthwise": (lambda: nn.Conv2d(4, 4, 3, groups=4, padding=1, stride=2), (1, 4, 4, 4)),
    "conv2d_same_dilated": (lambda: nn.Conv2d(3, 4, (3, 5), padding="same", dilation=2, bias=False), (1, 3, 3, 3)),
    "conv2d_reflect": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (1, 3, 3, 3)),
    "conv3d_grouped_strided": (lambda: nn.Conv3d(4, 4, 2, stride=2, groups=2, padding=1), (1, 4, 3, 3, 3)),
}


@pytest.mark.parametrize("case", sorted(CONVS))
def test_convolutions_of_every_kind_move_exactly(case: str) -> None:
    torch.manual_seed(0)
    make, shape = CONVS[case]
    conv = make()
    model = Head(conv, shape[1], conv.out_channels)
    x, y = torch.randn(*shape), torch.randint(0, 3, (shape[0],))
    assert_exact(model, x, y, ["body.weight"])


def test_linear_layers_move_exactly_and_the_report_names_them() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    assert assert_exact(model, x, y, ["2.weight", "2.bias", "4.weight"]) == {}


class Attention(nn.Module):
    def __init__(self, cross: bool, batch_first: bool, masks: bool, d: int = 8) -> None:
        super().__init__()
        self.cross, self.batch_first, self.masks = cross, batch_first, masks
        self.pre = nn.Linear(d, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=batch_first)
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, d)
        h = torch.tanh(self.pre(x))
        mem = x[:, :2] if self.cross else h  # cross: keys/values from another tensor (2 positions)
        q, kv = (h, mem) if self.batch_first else (h.transpose(0, 1), mem.transpose(0, 1))
        s, t = kv.shape[1 if self.batch_first else 0], h.shape[1]
        attn_mask = torch.triu(torch.ones(t, s, dtype=torch.bool), 1) if self.masks else None
        pad = torch.zeros(x.shape[0], s, dtype=torch.bool) if self.masks else None
        if pad is not None:
            pad[0, -1] = True
        out, _ = self.attn(q, kv, kv, attn_mask=attn_mask, key_padding_mask=pad, need_weights=False)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out.mean(1))


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("masks", [False, True], ids=["nomask", "masks"])
def test_multihead_attention_moves_its_packed_projections_exactly(cross: bool, batch_first: bool,
                                                                  masks: bool) -> None:
    torch.manual_seed(1)
    model = Attention(cross, batch_first, masks)
    x, y = torch.randn(2, 3, 8), torch.randint(0, 3, (2,))  # 6 query tokens < 9 input dims
    assert_exact(model, x, y, ["attn.in_proj_weight", "attn.out_proj.weight"])


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_transformer_layers_move_exactly_and_norms_stay(batch_first: bool, decoder: bool) -> None:
    torch.manual_seed(2)
    kw = {"d_model": 8, "nhead": 2, "dim_feedforward": 16, "dropout": 0.0, "batch_first": batch_first}
    layer = nn.TransformerDecoderLayer(**kw) if decoder else nn.TransformerEncoderLayer(**kw)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.head = layer, nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = x if batch_first else x.transpose(0, 1)
            h = self.layer(h, h[:2] if not batch_first else h[:, :2]) if decoder else self.layer(h)
            return self.head((h if batch_first else h.transpose(0, 1)).mean(1))

    model = Model()
    x, y = torch.randn(2, 3, 8), torch.randint(0, 3, (2,))
    untouched = assert_exact(model, x, y, ["layer.linear1.weight", "layer.linear2.weight",
                                           "layer.self_attn.out_proj.weight"])
    assert untouched["layer.norm1.weight"] == "used by layer_norm (not a linear map)"


class Conv1D(nn.Module):
    """GPT-2's Conv1D: W stored (in, out), y = addmm(b, x, W)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class RawLinear(nn.Module):
    """F.linear on raw Parameters, with the input passed by keyword."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_out, d_in) * 0.3)
        self.b = nn.Parameter(torch.zeros(d_out))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(input=x, weight=self.w, bias=self.b)


@pytest.mark.parametrize("kind", ["conv1d_gpt2", "raw_f_linear", "matmul_transposed"])
def test_functional_linear_maps_on_raw_parameters_move_exactly(kind: str) -> None:
    torch.manual_seed(3)
    mid: nn.Module = Conv1D(12, 8) if kind == "conv1d_gpt2" else RawLinear(8, 12)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.mid, self.out = nn.Linear(5, 8), mid, nn.Parameter(torch.randn(3, 12) * 0.3)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.mid(torch.tanh(self.inp(x))))  # (B, T, 12)
            return (h @ self.out.T).mean(1)  # a raw x @ Wᵀ head

    model = Model()
    x, y = torch.randn(2, 3, 5), torch.randint(0, 3, (2,))
    names = ["mid.weight", "mid.bias"] if kind == "conv1d_gpt2" else ["mid.w", "mid.b"]
    assert assert_exact(model, x, y, [*names, "out"]) == {}


class TinyLM(nn.Module):
    """Token embedding tied to the LM head, learned positions, one causal block."""

    def __init__(self, vocab: int = 20, d: int = 12) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(8, d)
        self.block = nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        h = self.wte(tokens) + self.wpe(torch.arange(t))
        h = self.block(h, src_mask=nn.Transformer.generate_square_subsequent_mask(t), is_causal=True)
        return F.linear(h, self.wte.weight)  # tied LM head, (B, T, V)


def lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def test_tied_embedding_and_lm_head_move_exactly_and_looked_up_rows_stay() -> None:
    torch.manual_seed(4)
    model = TinyLM()
    tokens = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])  # 10 positions < 13 head inputs
    table = model.wte.weight.detach().clone()
    assert_exact(model, tokens, tokens, ["wte.weight", "block.linear2.weight"], loss_fn=lm_loss)
    looked_up = torch.unique(tokens)
    others = torch.tensor([i for i in range(20) if i not in looked_up.tolist()])
    assert torch.equal(model.wte.weight[looked_up], table[looked_up])
    assert (model.wte.weight[others] - table[others]).norm() > 0


class Shared(nn.Module):
    """One weight in two Linear modules (own biases), and one Linear applied three times in a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.loop = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.pre(x))
        h = torch.tanh(self.a(x)) + torch.tanh(self.b(x * x))
        for _ in range(3):
            h = torch.tanh(self.loop(h))
        return self.head(h)


def test_shared_weights_and_a_linear_in_a_loop_move_exactly() -> None:
    torch.manual_seed(5)
    model = Shared()
    x, y = torch.randn(2, 8), torch.randint(0, 3, (2,))  # 2 uses × 2 columns < 9; loop 3 × 2 < 9
    untouched = assert_exact(model, x, y, ["a.weight", "loop.weight", "head.weight"])
    assert set(untouched) == {"b.bias"} and "a.weight" in untouched["b.bias"]


class Odd(nn.Module):
    """Parameters teleport must leave alone: a position table added to activations, a norm, weight_norm."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(3, 8) * 0.1)
        self.norm = nn.LayerNorm(8)
        self.wn = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))
        self.mid, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, 3, 8)
        h = self.norm(x + self.pos)
        h = torch.tanh(self.mid(torch.tanh(self.wn(h))))
        return self.head(h.mean(1))


def test_untouched_parameters_say_why_and_stay_exactly() -> None:
    torch.manual_seed(6)
    model = Odd()
    x, y = torch.randn(2, 3, 8), torch.randint(0, 3, (2,))
    untouched = assert_exact(model, x, y, ["mid.weight", "head.weight"])
    assert untouched["pos"] == "used by add (not a linear map)"
    assert untouched["norm.weight"] == "used by layer_norm (not a linear map)"
    assert untouched["wn.parametrizations.weight.original0"].startswith("used by _weight_norm")
    assert "not a trainable parameter" in untouched["wn.bias"]  # its weight cannot move: nor may it alone
