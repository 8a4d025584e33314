"""Step 1 of the algorithm (paper eqs. 9-11): each layer's input representation matrix R.

Every layer whose weights act linearly on its input is a matrix product ``W R`` once the input is
laid out as columns:

- ``nn.Linear``: ``R = [x_1, ..., x_n]`` (d_in, n·T) — token positions of a sequence are columns too,
  which is the paper's attention case (Q/K/V/O are Linear layers).
- ``nn.Conv1d`` / ``nn.Conv2d``: ``R = [X_1ᵀ, ..., X_nᵀ]`` (C_i·k·k, n·h_o·w_o), the unfolded patches,
  honouring stride, padding (any mode), dilation; one R per group.

The bias is folded in as a row of ones (the paper's "additional column to W and unity to x"), so
the update of ``[W | b]`` is projected as one matrix. Anything else that has parameters
(LayerNorm, BatchNorm, Embedding, a raw Parameter) is left untouched and listed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TELEPORTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d)


@dataclass
class LayerInputs:
    """One teleportable layer and the representation matrix of each of its groups."""

    name: str
    module: nn.Module
    kind: str  # "linear" | "conv1d" | "conv2d"
    groups: int
    chunks: list[list[Tensor]] = field(default_factory=list)  # per group: R blocks of every call

    def representation(self, group: int = 0) -> Tensor:
        """R for one group: (d, N), d = fan-in (+1 with bias), N = columns over all calls."""
        blocks = self.chunks[group]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)


def _with_ones(cols: Tensor, bias: bool) -> Tensor:
    """Append the row of ones that carries the bias: (d, N) -> (d+1, N)."""
    if not bias:
        return cols
    return torch.cat([cols, cols.new_ones(1, cols.shape[1])], dim=0)


def _explicit_pad(x: Tensor, conv: nn.Conv1d | nn.Conv2d) -> Tensor:
    """Apply the conv's padding (any mode, 'same'/'valid' included) to x, so unfold can use padding 0."""
    kernel, dilation = conv.kernel_size, conv.dilation
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return x
        pads: list[int] = []  # 'same': total = d·(k-1), extra on the right as PyTorch does
        for k, d in zip(reversed(kernel), reversed(dilation), strict=True):
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
    else:
        pads = [p for p in reversed(conv.padding) for _ in range(2)]
    if not any(pads):
        return x
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    return F.pad(x, pads, mode=mode)


def conv_columns(conv: nn.Conv1d | nn.Conv2d, x: Tensor) -> list[Tensor]:
    """Unfolded patches per group: each (C_i/g · k·k, n · h_o · w_o)."""
    x = _explicit_pad(x, conv)
    if isinstance(conv, nn.Conv1d):  # (n, C, L) -> (n, C, 1, L): a 2-D conv with a 1-row kernel
        x = x.unsqueeze(2)
        kernel, dilation, stride = (1, *conv.kernel_size), (1, *conv.dilation), (1, *conv.stride)
    else:
        kernel, dilation, stride = conv.kernel_size, conv.dilation, conv.stride
    per_group = x.shape[1] // conv.groups
    out = []
    for g in range(conv.groups):
        xg = x[:, g * per_group : (g + 1) * per_group]
        patches = F.unfold(xg, kernel, dilation=dilation, padding=0, stride=stride)  # (n, C_g·k·k, L)
        out.append(patches.transpose(0, 1).reshape(patches.shape[1], -1))  # (C_g·k·k, n·L)
    return out


def layer_columns(module: nn.Module, x: Tensor) -> list[Tensor]:
    """The representation columns one forward call contributes, per group, bias row included."""
    bias = module.bias is not None
    if isinstance(module, nn.Linear):
        cols = [x.reshape(-1, x.shape[-1]).T]  # (d_in, n·T)
    else:
        cols = conv_columns(module, x)  # type: ignore[arg-type]
    return [_with_ones(c, bias) for c in cols]


def weight_matrix(module: nn.Module) -> Tensor:
    """[W | b] as (C_o, d): rows are output units, columns line up with R's rows. A copy."""
    w = module.weight.reshape(module.weight.shape[0], -1)
    if module.bias is None:
        return w.detach().clone()
    return torch.cat([w, module.bias.reshape(-1, 1)], dim=1).detach().clone()


def teleportable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TELEPORTABLE)]


@contextmanager
def capture_inputs(model: nn.Module) -> Iterator[dict[str, LayerInputs]]:
    """Record R for every Linear/Conv layer during the forward passes run inside the block.

    Layers that are never called stay absent from the dict (and are reported as untouched).
    """
    captured: dict[str, LayerInputs] = {}
    handles = []
    # Q, K and V read the same tensor: build its columns once, so the bases are computed once too.
    # The cache holds x itself so its storage (and data_ptr) cannot be reused by another tensor.
    shared: dict[tuple, tuple[Tensor, list[Tensor]]] = {}

    def make_hook(name: str, module: nn.Module):
        kind = type(module).__name__.lower()
        groups = getattr(module, "groups", 1)

        def hook(mod: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach()
            key = (x.data_ptr(), tuple(x.shape), x.stride(), mod.bias is not None)
            if isinstance(mod, nn.Linear) and key in shared:
                cols = shared[key][1]
            else:
                cols = layer_columns(mod, x)
                if isinstance(mod, nn.Linear):
                    shared[key] = (x, cols)
            entry = captured.setdefault(name, LayerInputs(name, mod, kind, groups, [[] for _ in cols]))
            for g, c in enumerate(cols):
                entry.chunks[g].append(c)

        return hook

    for name, module in teleportable_layers(model):
        handles.append(module.register_forward_pre_hook(make_hook(name, module)))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def untouched_parameters(model: nn.Module, captured: dict[str, LayerInputs]) -> list[str]:
    """Names of trainable parameters that teleport leaves as they are (norms, embeddings, unused layers)."""
    moved = {id(p) for entry in captured.values() for p in entry.module.parameters(recurse=False)}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in moved]
