"""The model families exact teleport is tested on: one seeded builder per case, shared by
``test_uses`` (one process) and ``test_distributed`` (gloo ranks).

Build under float64 (``torch.set_default_dtype``). Every forward treats each sample on its own
(masks come from the data, never from a sample's place in the batch) and every loss is a mean over
samples, so a batch split across ranks has the same objective as the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from teleport import TeleportConfig

LossFn = Callable[[Tensor, Tensor], Tensor]
OPEN = TeleportConfig(steps=3, lr=0.1, cap=1e9, tau=1.0, loss_tol=1.0)  # nothing is backed off for drift


@dataclass
class Case:
    """A model, its teleport batch, and the parameters an exact teleport must move."""

    model: nn.Module
    x: Tensor
    y: Tensor
    moved: list[str]
    loss_fn: LossFn = field(default=F.cross_entropy)


def drawn_on_cpu(build: Callable[[], Case]) -> Case:
    """``build()`` drawn by the CPU's generator, then moved to the test's device (``TLAB_TEST_DEVICE``): the same
    weights and batch on every device, so a test whose guard branch hangs on the numbers reaches it there too (the
    CUDA generator draws other numbers from the same seed)."""
    device = torch.get_default_device()
    with torch.device("cpu"):
        case = build()
    return Case(case.model.to(device), case.x.to(device), case.y.to(device), case.moved, case.loss_fn)


class Head(nn.Module):
    """x -> tanh(pre(x)) -> body -> tanh -> mean over all but the batch -> a Linear head."""

    def __init__(self, body: nn.Module, c_in: int, c_body: int, classes: int = 3) -> None:
        super().__init__()
        # a 1×1 conv (a Linear) in front: a layer reading the data itself cannot move at τ = 1, its
        # teleport gradient lies in the span of its inputs
        self.pre = type(body)(c_in, c_in, 1) if isinstance(body, nn.modules.conv._ConvNd) else nn.Linear(c_in, c_in)
        self.body, self.head = body, nn.Linear(c_body, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.body(torch.tanh(self.pre(x))))
        return self.head(h.flatten(2).mean(-1))


CONVS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {  # 2 samples: fewer columns than rows
    "conv1d_grouped_strided_dilated_padded": (lambda: nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=2,
                                                                groups=2), (2, 4, 5)),
    "conv2d_depthwise": (lambda: nn.Conv2d(4, 4, 3, groups=4, padding=1, stride=2), (2, 4, 4, 4)),
    "conv2d_same_dilated": (lambda: nn.Conv2d(3, 4, (3, 5), padding="same", dilation=2, bias=False), (2, 3, 3, 3)),
    "conv2d_reflect": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 3, 3)),
    "conv3d_grouped_strided": (lambda: nn.Conv3d(4, 4, 2, stride=2, groups=2, padding=1), (2, 4, 3, 3, 3)),
}


def conv(name: str) -> Case:
    torch.manual_seed(0)
    make, shape = CONVS[name]
    body = make()
    return Case(Head(body, shape[1], body.out_channels), torch.randn(*shape), torch.randint(0, 3, (shape[0],)),
                ["body.weight"])


def linear() -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    return Case(model, torch.randn(8, 6), torch.randint(0, 3, (8,)), ["2.weight", "2.bias", "4.weight"])


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
        attn_mask = torch.triu(torch.ones(t, s, dtype=torch.bool, device=x.device), 1) if self.masks else None
        pad = None
        if self.masks:  # the last key is padding in the samples whose last key position reads x > 0
            pad = torch.zeros(x.shape[0], s, dtype=torch.bool, device=x.device)
            pad[:, -1] = x[:, s - 1, 0] > 0
        out, _ = self.attn(q, kv, kv, attn_mask=attn_mask, key_padding_mask=pad, need_weights=False)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out.mean(1))


def attention(cross: bool, batch_first: bool, masks: bool) -> Case:
    torch.manual_seed(1)
    model = Attention(cross, batch_first, masks)
    x, y = torch.randn(2, 3, 8), torch.randint(0, 3, (2,))  # 6 query tokens < 9 input dims
    return Case(model, x, y, ["attn.in_proj_weight", "attn.out_proj.weight"])


class TransformerHead(nn.Module):
    """One nn.TransformerEncoderLayer (or DecoderLayer reading its own first 2 positions), a Linear head."""

    def __init__(self, batch_first: bool, decoder: bool) -> None:
        super().__init__()
        kw = {"d_model": 8, "nhead": 2, "dim_feedforward": 16, "dropout": 0.0, "batch_first": batch_first}
        self.layer = nn.TransformerDecoderLayer(**kw) if decoder else nn.TransformerEncoderLayer(**kw)
        self.head, self.batch_first, self.decoder = nn.Linear(8, 3), batch_first, decoder

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, 8)
        h = x if self.batch_first else x.transpose(0, 1)
        memory = h[:, :2] if self.batch_first else h[:2]
        h = self.layer(h, memory) if self.decoder else self.layer(h)
        return self.head((h if self.batch_first else h.transpose(0, 1)).mean(1))


def transformer(batch_first: bool, decoder: bool) -> Case:
    torch.manual_seed(2)
    model = TransformerHead(batch_first, decoder)
    x, y = torch.randn(2, 3, 8), torch.randint(0, 3, (2,))
    return Case(model, x, y, ["layer.linear1.weight", "layer.linear2.weight", "layer.self_attn.out_proj.weight"])


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


class FunctionalHead(nn.Module):
    """Linear -> ``mid`` (GPT-2 Conv1D or raw F.linear) -> a raw x @ Wᵀ head on a Parameter."""

    def __init__(self, mid: nn.Module) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(5, 8), mid, nn.Parameter(torch.randn(3, 12) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))  # (B, T, 12)
        return (h @ self.out.T).mean(1)


def functional(kind: str) -> Case:
    torch.manual_seed(3)
    model = FunctionalHead(Conv1D(12, 8) if kind == "conv1d_gpt2" else RawLinear(8, 12))
    x, y = torch.randn(2, 3, 5), torch.randint(0, 3, (2,))
    names = ["mid.weight", "mid.bias"] if kind == "conv1d_gpt2" else ["mid.w", "mid.b"]
    return Case(model, x, y, [*names, "out"])


class TinyLM(nn.Module):
    """Token embedding tied to the LM head, learned positions, one causal block."""

    def __init__(self, vocab: int = 20, d: int = 12) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(8, d)
        self.block = nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        h = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        h = self.block(h, src_mask=mask, is_causal=True)
        return F.linear(h, self.wte.weight)  # tied LM head, (B, T, V)


def lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def tiny_lm() -> Case:
    torch.manual_seed(4)
    tokens = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])  # 10 positions < 13 head inputs
    return Case(TinyLM(), tokens, tokens, ["wte.weight", "block.linear2.weight"], lm_loss)


def rotary(x: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding of (B, heads, T, head_size): each pair of features turned by its position's angle."""
    half = torch.arange(0, x.shape[-1], 2, dtype=x.dtype, device=x.device) / x.shape[-1]
    angle = torch.arange(x.shape[-2], dtype=x.dtype, device=x.device)[:, None] * base ** -half
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack([even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()], -1).flatten(-2)


class LlamaBlock(nn.Module):
    """A Llama-style block: RMSNorm, grouped-query causal attention with rotary positions, a SwiGLU MLP, no biases."""

    def __init__(self, d: int = 16, heads: int = 4, kv_heads: int = 2, hidden: int = 24) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hs = heads, kv_heads, d // heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q, self.o = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k, self.v = nn.Linear(d, kv_heads * self.hs, bias=False), nn.Linear(d, kv_heads * self.hs, bias=False)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        a = self.norm1(x)
        q, k, v = (proj(a).view(b, t, n, self.hs).transpose(1, 2)
                   for proj, n in ((self.q, self.heads), (self.k, self.kv_heads), (self.v, self.kv_heads)))
        group = self.heads // self.kv_heads
        y = F.scaled_dot_product_attention(rotary(q), rotary(k).repeat_interleave(group, 1),
                                           v.repeat_interleave(group, 1), is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Token embedding, two Llama blocks, a final RMSNorm and an untied LM head."""

    def __init__(self, vocab: int = 20, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([LlamaBlock(d), LlamaBlock(d)])
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def llama() -> Case:
    torch.manual_seed(7)
    tokens = torch.randint(0, 20, (2, 6))  # 12 positions < 16 inputs of every projection
    moved = [f"blocks.{i}.{name}.weight" for i in (0, 1) for name in ("q", "k", "v", "o", "gate", "up", "down")]
    return Case(Llama(), tokens, tokens, [*moved, "head.weight"], lm_loss)


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


def shared() -> Case:
    torch.manual_seed(5)
    x, y = torch.randn(2, 8), torch.randint(0, 3, (2,))  # 2 uses × 2 columns < 9; loop 3 × 2 < 9
    return Case(Shared(), x, y, ["a.weight", "loop.weight", "head.weight"])


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


def odd() -> Case:
    torch.manual_seed(6)
    return Case(Odd(), torch.randn(2, 3, 8), torch.randint(0, 3, (2,)), ["mid.weight", "head.weight"])


def _every_case() -> dict[str, Callable[[], Case]]:
    cases: dict[str, Callable[[], Case]] = {f"conv-{n}": (lambda n=n: conv(n)) for n in CONVS}
    for cross in (False, True):
        for batch_first in (True, False):
            for masks in (False, True):
                name = f"attention-{'cross' if cross else 'self'}-{batch_first=}-{masks=}"
                cases[name] = lambda c=cross, b=batch_first, m=masks: attention(c, b, m)
    for batch_first in (True, False):
        for decoder in (False, True):
            cases[f"transformer-{'decoder' if decoder else 'encoder'}-{batch_first=}"] = (
                lambda b=batch_first, d=decoder: transformer(b, d))
    cases |= {f"functional-{k}": (lambda k=k: functional(k)) for k in ("conv1d_gpt2", "raw_f_linear")}
    return cases | {"linear": linear, "tied_lm": tiny_lm, "llama": llama, "shared_and_loop": shared, "untouched": odd}


CASES = _every_case()  # name -> builder (seeded: the same case in every process)
