"""The linear maps a parameter can take part in, each turned into the input columns X it sees.

One use of a weight W (or of a view of it) as the matrix of a linear map is ``W[rows] X``:
``F.linear`` / ``addmm`` / ``matmul`` / ``mm`` / ``bmm`` with the parameter on either side, and
convolutions of any dimension (groups, stride, dilation, padding). Each gives ``Part``s: which
rows of the parameter's layout it uses, and how to build X (built lazily: only when a teleport
takes a step). An embedding lookup gives the rows it reads, which must stay fixed.

Layouts: a parameter is seen as a matrix (rows, C). ``natural`` is ``p.reshape(p.shape[0], -1)``
(Linear's (out, in), a conv's (C_o, C_i/g·Πk), an embedding's (V, d)); ``transposed`` is ``p.T``
of a 2-D p (GPT-2's Conv1D stores W as (in, out) and computes ``addmm(b, x, W)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# A tracked tensor's elements as flat indices into its parameter: None = the parameter itself,
# "T" = the parameter transposed (2-D), else an integer tensor of the tensor's shape.
Index = Tensor | str | None


class Unsupported(Exception):
    """A use the library cannot express as a linear map of a parameter's rows; the message says why."""


@dataclass
class Part:
    """One use of some rows of a weight's layout as a linear map on X (C, N)."""

    layout: str  # "natural" | "transposed"
    rows: Tensor | None  # layout rows used (None: all of them, in order)
    columns: Callable[[], Tensor]  # builds X (C, N)
    key: tuple  # equal keys: equal X (so Q/K/V reading one tensor share one basis)
    kind: str  # "linear" | "matmul" | "conv2d" | ...
    bias: int | None = None  # the tracked bias parameter added to these rows, if any
    bias_index: Index = None  # its elements, one per row (None: the whole bias, in order)
    fixed_input: bool = False  # X depends on no trainable parameter (it requires no grad): the data, say


def arange_index(p: Tensor, index: Index) -> Tensor:
    """Materialize an index: flat element numbers of p, shaped like the tracked tensor."""
    base = torch.arange(p.numel(), device=p.device).view(p.shape)
    if index is None:
        return base
    if isinstance(index, str):
        return base.T
    return index


def matrix_rows(p: Tensor, index: Index, want: str | None = None) -> tuple[str, Tensor | None]:
    """(layout, rows) of a 2-D matrix use whose matrix is ``index`` of p (rows = the map's outputs).

    ``want`` forces a layout (a weight's layout must agree across all its uses).
    """
    if index is None and want in (None, "natural"):
        return "natural", None
    if isinstance(index, str) and want in (None, "transposed"):
        return "transposed", None
    idx = arange_index(p, index)
    if idx.dim() != 2:
        raise Unsupported(f"used as a {idx.dim()}-D matrix")
    for layout in ("natural", "transposed") if want is None else (want,):
        rows = _rows_in(p, idx, layout)
        if rows is not None:
            return layout, rows
    raise Unsupported("used as a matrix whose rows are not rows of the parameter (nor of its transpose)")


def _rows_in(p: Tensor, idx: Tensor, layout: str) -> Tensor | None:
    """Layout rows of idx (r, C) if each of its rows is a whole layout row in order, else None."""
    if p.dim() < 2 or (layout == "transposed" and p.dim() != 2):
        return None
    if layout == "natural":
        c = p.numel() // p.shape[0]
        row, col = idx // c, idx % c
    else:
        c = p.shape[0]
        row, col = idx % p.shape[1], idx // p.shape[1]
    if idx.shape[1] != c or not bool((col == torch.arange(c, device=idx.device)).all()):
        return None
    if not bool((row == row[:, :1]).all()):
        return None
    return row[:, 0].contiguous()


def _batched_matrix(p: Tensor, index: Index, dims: int) -> Index:
    """A matmul operand with batch dims must be one matrix broadcast over them (an expand of it)."""
    if dims <= 2:
        return index
    idx = arange_index(p, index)
    first = idx[(0,) * (dims - 2)]
    if not bool((idx == first).all()):
        raise Unsupported("used as a batch of different matrices (bmm on a 3-D parameter)")
    return first


def _conv_columns(x: Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], padding: Any,
                  dilation: tuple[int, ...], groups: int) -> list[Tensor]:
    """Unfolded patches of an N-d conv per group: each (C_i/g · Πk, n · Πo), rows in the weight's order."""
    dims = len(kernel)
    if x.dim() == dims + 1:  # unbatched input (C, *spatial)
        x = x.unsqueeze(0)
    if isinstance(padding, str):
        pads: list[int] = []
        if padding == "same":  # total = d·(k-1), extra on the right as PyTorch does
            for k, d in zip(reversed(kernel), reversed(dilation), strict=True):
                pads += [d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2]
    else:
        pads = [p for p in reversed(padding) for _ in range(2)]
    if any(pads):
        x = F.pad(x, pads)
    for i in range(dims):  # each spatial dim -> (..., o_i) and a trailing window (k_i)
        span = dilation[i] * (kernel[i] - 1) + 1
        x = x.unfold(2 + i, span, stride[i])
        if dilation[i] > 1:
            x = x[..., :: dilation[i]]
    n, c = x.shape[:2]
    perm = [1, *range(2 + dims, 2 + 2 * dims), 0, *range(2, 2 + dims)]  # (C, k..., n, o...)
    cols = x.permute(perm).reshape(c * _prod(kernel), -1)  # (C·Πk, n·Πo)
    per = cols.shape[0] // groups
    return [cols[g * per : (g + 1) * per] for g in range(groups)]


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for v in xs:
        out *= v
    return out


def _tuple(v: Any, n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, list | tuple) else (int(v),) * n


def conv_parts(x: Tensor, weight: Tensor, widx: Index, bias: int | None, bidx: Index, call: dict[str, Any],
               dims: int) -> list[Part]:
    """A conv{dims}d use: group g uses rows [g·C_o/g, (g+1)·C_o/g) on its own unfolded patches."""
    if widx is not None:
        raise Unsupported(f"conv{dims}d on a view of the parameter")
    groups = int(call.get("groups", 1))
    kernel = tuple(weight.shape[2:])
    stride, dilation = _tuple(call.get("stride", 1), dims), _tuple(call.get("dilation", 1), dims)
    padding = call.get("padding", 0)
    padding = padding if isinstance(padding, str) else _tuple(padding, dims)
    xd = x.detach()
    cache: dict[str, list[Tensor]] = {}

    def group_columns(g: int) -> Callable[[], Tensor]:
        def build() -> Tensor:
            if "cols" not in cache:
                cache["cols"] = _conv_columns(xd, kernel, stride, padding, dilation, groups)
            return cache["cols"][g]
        return build

    rows = weight.shape[0] // groups
    key = (id(x), kernel, stride, padding, dilation, groups)  # the caller keeps x alive
    out = []
    for g in range(groups):
        r = None if groups == 1 else torch.arange(g * rows, (g + 1) * rows, device=weight.device)
        b_index = bidx if groups == 1 or bias is None else _slice_index(bidx, g * rows, (g + 1) * rows, weight)
        out.append(Part("natural", r, group_columns(g), (*key, g), f"conv{dims}d", bias, b_index,
                        not x.requires_grad))
    return out


def _slice_index(index: Index, start: int, stop: int, like: Tensor) -> Tensor:
    if index is None:
        return torch.arange(start, stop, device=like.device)
    assert isinstance(index, Tensor)
    return index[start:stop]


def linear_columns(x: Tensor, fan_in: int) -> Callable[[], Tensor]:
    """X of ``x @ Wᵀ``: every leading position of x is a column, (fan_in, N)."""
    xd = x.detach()
    return lambda: xd.reshape(-1, fan_in).T


def left_columns(b: Tensor, fan_in: int) -> Callable[[], Tensor]:
    """X of ``W @ b``: the columns of every matrix of b, (fan_in, N)."""
    bd = b.detach()
    if bd.dim() == 1:
        return lambda: bd.reshape(fan_in, 1)
    return lambda: bd.transpose(-1, -2).reshape(-1, fan_in).T


def matrix_part(p: Tensor, index: Index, other: Tensor, tracked_left: bool, kind: str) -> Part:
    """``A @ other`` (tracked_left) or ``other @ B``: the map's matrix and its input columns."""
    dims = p.dim() if index is None or isinstance(index, str) else index.dim()
    if dims < 2:
        raise Unsupported(f"used as a vector in {kind}")
    index = _batched_matrix(p, index, dims)
    if tracked_left:  # rows of A are outputs; X = columns of other
        layout, rows = matrix_rows(p, index)
        fan_in = p.numel() // p.shape[0] if layout == "natural" else p.shape[0]
        return Part(layout, rows, left_columns(other, fan_in), (id(other), "left"), kind,
                    fixed_input=not other.requires_grad)
    t_index: Index  # other @ B: the map's matrix is Bᵀ
    if index is None:
        t_index = "T" if p.dim() == 2 else None
        if p.dim() != 2:
            raise Unsupported(f"used as a {p.dim()}-D right operand of {kind}")
    elif isinstance(index, str):
        t_index = None
    else:
        t_index = index.T
    layout, rows = matrix_rows(p, t_index)
    fan_in = p.numel() // p.shape[0] if layout == "natural" else p.shape[0]
    return Part(layout, rows, linear_columns(other, fan_in), (id(other), "right"), kind,
                fixed_input=not other.requires_grad)
