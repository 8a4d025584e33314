"""A GPT-2 style decoder: a token embedding tied to the LM head, learned positions, pre-LN blocks of
``nn.MultiheadAttention`` (causal) and an MLP of GPT-2's ``Conv1D`` layers (``addmm(b, x, W)``, W stored
(in, out)). Teleport moves every one of these weights under the constraints of all their uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Conv1D(nn.Module):
    """GPT-2's Conv1D: a linear map whose weight is stored (in, out), computed as addmm(bias, x, weight)."""

    def __init__(self, n_out: int, n_in: int) -> None:
        super().__init__()
        self.n_out = n_out
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape[:-1] + (self.n_out,)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)


class Block(nn.Module):
    """x + attn(LN(x)) with a causal mask, then x + MLP(LN(x)) with GELU."""

    def __init__(self, d: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc, self.proj = Conv1D(mlp_ratio * d, d), Conv1D(d, mlp_ratio * d)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)  # True: may not attend
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """tokens (B, T) int64 -> next-token logits (B, T, vocab); the LM head is the token embedding."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, max_len: int, mlp_ratio: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(d, heads, mlp_ratio) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln_f(h), self.wte.weight)  # tied: logits = h @ wte.weight.T


def gpt(vocab: int = 97, d: int = 32, heads: int = 2, layers: int = 1, max_len: int = 64,
        mlp_ratio: int = 2) -> nn.Module:
    """The factory: ``model: {kind: custom, factory: "tiny_lm.model:gpt", args: {d: 32, layers: 1}}``."""
    if d % heads:
        raise ValueError(f"d={d} must be a multiple of heads={heads}")
    return GPT(vocab, d, heads, layers, max_len, mlp_ratio)
