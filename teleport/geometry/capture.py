"""Step 1 of the algorithm (paper eqs. 9-11), per parameter: every use of it in the teleport forward pass.

The paper's representation matrix R of a layer is the input its weights multiply. Real models
reuse weights (a token embedding tied to the LM head, one Linear applied in a loop, packed Q/K/V
inside ``nn.MultiheadAttention``, GPT-2's ``Conv1D`` computing ``addmm(b, x, W)``), so R belongs
to a *parameter*: an update is loss-preserving only if it is null for every use of it. A
``TorchFunctionMode`` sees every torch function the forward calls and records, per parameter:

- each use as the matrix of a linear map (``teleport.geometry.uses``), with the rows it touches and its X;
- each embedding lookup: the rows read on the batch, which stay fixed;
- views of a parameter (slices, ``.T``, ``chunk``/``split``, casts) map back to the parameter's
  elements, so ``in_proj_weight[:E]`` is rows 0..E-1 of ``in_proj_weight``;
- anything else (an elementwise use, a norm, an op it does not know): the parameter stays
  exactly as it is, with the reason (``pos: used by add (not a linear map)``).

Decision (measured): the mode replaces the module hooks. It sees raw ``F.linear``, tied and
shared weights and MultiheadAttention's internals, which hooks cannot, and it costs no more: one
capture forward (L and ∇L with its graph, 1 thread, medians of 25) over the plain 7.45 ms of an
MLP [1024, 1024] on 32 digits-sized inputs costs +0.40 ms with the mode, +0.41 ms with the old
hooks; on a 2-layer transformer (32 × 16 tokens) +1.2 ms vs +5.5 ms, since the mode only keeps
references and builds X lazily (not at all for a batch already at CAP). It runs once per teleport
batch, not per step. ``F.multi_head_attention_forward`` is one overridable call: the mode runs a
copy of it whose own dispatch check is off, so its ``linear`` calls on slices of ``in_proj_weight``
are seen one by one.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from teleport.geometry.uses import (
    Index,
    Part,
    Unsupported,
    arange_index,
    conv_parts,
    linear_columns,
    matrix_part,
    matrix_rows,
)

# value-independent reads: shape, dtype, device, ... and ops that only use a tensor's metadata
METADATA = frozenset({
    "dim", "size", "numel", "stride", "is_contiguous", "data_ptr", "element_size", "nelement",
    "is_floating_point", "is_complex", "get_device", "__len__", "__format__", "__repr__", "storage_offset",
    "untyped_storage", "new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
    "requires_grad_", "retain_grad", "register_hook", "__hash__",
})
VIEWS = frozenset({
    "__getitem__", "view", "reshape", "flatten", "unflatten", "transpose", "t", "permute", "chunk", "split",
    "split_with_sizes", "tensor_split", "unbind", "select", "narrow", "squeeze", "unsqueeze", "expand",
    "expand_as", "view_as", "reshape_as", "movedim", "moveaxis", "swapaxes", "swapdims", "T", "mT",
})
SAME_ELEMENTS = frozenset({"contiguous", "clone", "detach", "data", "to", "float", "double", "half", "bfloat16",
                           "type_as"})
MATMULS = frozenset({"matmul", "mm", "bmm", "__matmul__", "__rmatmul__"})
SIGNATURES = MappingProxyType({  # positional names of the calls the recorder reads
    "linear": ("input", "weight", "bias"),
    "addmm": ("input", "mat1", "mat2"),
    "conv": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    "embedding": ("input", "weight", "padding_idx", "max_norm"),
})


def _mha_seen_inside() -> Any:
    """F.multi_head_attention_forward with its ``has_torch_function`` check off: its internals reach the mode."""
    f = F.multi_head_attention_forward
    globs = dict(f.__globals__, has_torch_function=lambda *_: False)
    g = types.FunctionType(f.__code__, globs, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__ = f.__kwdefaults__
    return g


def op_name(func: Any) -> str:
    """'linear', 'add', 'shape' (a property read), ... for a function the mode receives."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name or repr(func)


def _call_args(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    out = dict(zip(names, args, strict=False))
    out.update(kwargs)
    return out


@dataclass
class Uses:
    """What the capture forward did with each trainable parameter (indexed like ``params``)."""

    names: list[str]
    params: list[Tensor]
    parts: dict[int, list[Part]] = field(default_factory=dict)
    frozen: dict[int, list[tuple[str, Tensor]]] = field(default_factory=dict)  # ("rows"|"elements", idx)
    reasons: dict[int, str] = field(default_factory=dict)
    bias_of: dict[int, set[int]] = field(default_factory=dict)  # bias param -> weights it was added to
    keepalive: list[Tensor] = field(default_factory=list)  # the inputs whose ids key the parts

    def refuse(self, i: int, why: str) -> None:
        self.reasons.setdefault(i, why)


class UseRecorder(TorchFunctionMode):
    """Records ``Uses`` of ``params`` during the torch calls made inside ``with recorder:``."""

    def __init__(self, names: list[str], params: list[Tensor]) -> None:
        super().__init__()
        self.uses = Uses(names, params)
        # id of a parameter or a view of one -> (parameter index, its elements as an Index, the parameter)
        self.tracked: dict[int, tuple[int, Index, Tensor]] = {id(p): (i, None, p) for i, p in enumerate(params)}
        self._mha = _mha_seen_inside()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            with self:  # run its body with the mode on: its linear calls are recorded one by one
                return self._mha(*args, **kwargs)
        hits = self._tracked_in(args, kwargs)
        out = func(*args, **kwargs)
        if hits:
            self._record(op_name(func), args, kwargs, hits, out)
        return out

    def track(self, t: Any) -> tuple[int, Index, Tensor] | None:
        return self.tracked.get(id(t)) if isinstance(t, Tensor) else None

    def _tracked_in(self, args: tuple, kwargs: dict) -> list[tuple[int, Index, Tensor]]:
        hits = []
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, list | tuple) else (a,):
                hit = self.track(t)
                if hit is not None:
                    hits.append(hit)
        return hits

    def _record(self, name: str, args: tuple, kwargs: dict, hits: list, out: Any) -> None:
        if name in METADATA or name in {"shape", "dtype", "device", "requires_grad", "is_cuda", "ndim", "grad",
                                        "is_leaf", "grad_fn", "layout", "is_sparse", "is_nested", "_base"}:
            return
        try:
            if name in VIEWS or name in SAME_ELEMENTS:
                self._derive(name, args, kwargs, hits, out)
            elif name == "linear":
                self._linear(_call_args(SIGNATURES["linear"], args, kwargs))
            elif name == "addmm":
                self._addmm(_call_args(SIGNATURES["addmm"], args, kwargs))
            elif name in MATMULS:
                a, b = (args[1], args[0]) if name == "__rmatmul__" else (args[0], args[1] if len(args) > 1
                                                                         else kwargs["other"])
                self._matmul(a, b, name.strip("_"))
            elif name in ("conv1d", "conv2d", "conv3d"):
                self._conv(_call_args(SIGNATURES["conv"], args, kwargs), int(name[4]))
            elif name == "embedding":
                self._embedding(_call_args(SIGNATURES["embedding"], args, kwargs))
            else:
                raise Unsupported(f"used by {name} (not a linear map)")
        except Unsupported as e:
            for i, _, _ in hits:
                self.uses.refuse(i, str(e))

    # ------------------------------------------------------------------ views

    def _derive(self, name: str, args: tuple, kwargs: dict, hits: list, out: Any) -> None:
        if len(hits) != 1:
            raise Unsupported(f"used by {name} together with another parameter")
        i, index, p = hits[0]
        src = args[0] if args else kwargs.get("input")
        if self.track(src) is None:  # x.type_as(W), x.view_as(W): only W's metadata is read
            return
        if name in SAME_ELEMENTS or (name in ("T", "mT", "t") and index is None and p.dim() == 2):
            new: Any = "T" if name in ("T", "mT", "t") else index
            self._track_outputs(out, i, lambda _: new, p)
            return
        idx = arange_index(p, index)
        sub = tuple(idx if a is src else a for a in args)
        mapped = getattr(torch.Tensor, name).__get__(idx) if name in ("T", "mT") else None
        if mapped is None:
            mapped = getattr(torch.Tensor, name)(*sub, **kwargs)
        self._track_outputs(out, i, lambda k: mapped if k is None else mapped[k], p)

    def _track_outputs(self, out: Any, i: int, index_of: Any, p: Tensor) -> None:
        """Views of parameter i: tracked by id (kept alive, so the id is not reused) with their elements."""
        outs = [(None, out)] if isinstance(out, Tensor) else list(enumerate(out))
        for k, t in outs:
            if isinstance(t, Tensor):
                self.tracked[id(t)] = (i, index_of(k), p)
                self.uses.keepalive.append(t)

    # ------------------------------------------------------------------ linear maps

    def _input(self, x: Any, what: str) -> Tensor:
        hit = self.track(x)
        if hit is not None:
            self.uses.refuse(hit[0], f"used as the input of {what} (a product of parameters)")
            raise Unsupported(f"multiplied by a parameter in {what}")
        if not isinstance(x, Tensor):
            raise Unsupported(f"{what} on a non-tensor input")
        self.uses.keepalive.append(x)
        return x

    def _add_part(self, weight: tuple[int, Index, Tensor], part: Part, bias: Any = None) -> None:
        i = weight[0]
        b = self.track(bias)
        if b is not None:
            part.bias, part.bias_index = b[0], b[1]
            self.uses.bias_of.setdefault(b[0], set()).add(i)
        self.uses.parts.setdefault(i, []).append(part)

    def _linear(self, call: dict[str, Any]) -> None:
        w = self.track(call["weight"])
        x = self._input(call["input"], "linear")
        if w is None:
            self._orphan_bias(call.get("bias"), "linear")
            return
        i, index, p = w
        layout, rows = matrix_rows(p, index)
        fan_in = call["weight"].shape[-1]
        part = Part(layout, rows, linear_columns(x, fan_in), (id(x), "right"), "linear",
                    fixed_input=not x.requires_grad)
        self._add_part(w, part, call.get("bias"))

    def _addmm(self, call: dict[str, Any]) -> None:
        m1, m2 = self.track(call["mat1"]), self.track(call["mat2"])
        if m1 is not None and m2 is not None:
            raise Unsupported("used by addmm on two parameters (not linear in either)")
        if m1 is None and m2 is None:
            self._orphan_bias(call["input"], "addmm")
            return
        bias = call["input"]
        if m2 is not None:  # addmm(b, x, W): W (in, out) as in GPT-2's Conv1D; b broadcasts over rows
            x = self._input(call["mat1"], "addmm")
            part = matrix_part(m2[2], m2[1], x, False, "addmm")
            self._bias_ok(bias, (call["mat2"].shape[-1],))
            self._add_part(m2, part, bias)
        else:
            assert m1 is not None
            y = self._input(call["mat2"], "addmm")
            part = matrix_part(m1[2], m1[1], y, True, "addmm")
            if self.track(bias) is not None:
                raise Unsupported("added as a column bias to addmm (not supported)")
            self._add_part(m1, part)

    def _bias_ok(self, bias: Any, shape: tuple[int, ...]) -> None:
        hit = self.track(bias)
        if hit is not None and tuple(bias.shape) not in (shape, (1, *shape)):
            raise Unsupported(f"added as a bias of shape {tuple(bias.shape)} (only per-output biases)")

    def _orphan_bias(self, bias: Any, what: str) -> None:
        hit = self.track(bias)
        if hit is not None:
            raise Unsupported(f"the bias of a {what} whose weight is not a trainable parameter")

    def _matmul(self, a: Any, b: Any, kind: str) -> None:
        ta, tb = self.track(a), self.track(b)
        if ta is not None and tb is not None:
            raise Unsupported(f"used by {kind} on two parameters (not linear in either)")
        if ta is not None:
            self._add_part(ta, matrix_part(ta[2], ta[1], self._input(b, kind), True, kind))
        elif tb is not None:
            self._add_part(tb, matrix_part(tb[2], tb[1], self._input(a, kind), False, kind))

    def _conv(self, call: dict[str, Any], dims: int) -> None:
        w = self.track(call["weight"])
        x = self._input(call["input"], f"conv{dims}d")
        if w is None:
            self._orphan_bias(call.get("bias"), f"conv{dims}d")
            return
        b = self.track(call.get("bias"))
        parts = conv_parts(x, call["weight"], w[1], None if b is None else b[0], None if b is None else b[1],
                           call, dims)
        for part in parts:
            self.uses.parts.setdefault(w[0], []).append(part)
        if b is not None:
            self.uses.bias_of.setdefault(b[0], set()).add(w[0])

    def _embedding(self, call: dict[str, Any]) -> None:
        w = self.track(call["weight"])
        if w is None:
            return
        if self.track(call["input"]) is not None:
            raise Unsupported("used as the indices of an embedding")
        if call.get("max_norm") is not None:
            raise Unsupported("looked up with max_norm (renormalizes the table in place)")
        i, index, p = w
        looked_up = torch.unique(call["input"].detach().reshape(-1))
        if index is None:
            self.uses.frozen.setdefault(i, []).append(("rows", looked_up))
        else:
            self.uses.frozen.setdefault(i, []).append(("elements", arange_index(p, index)[looked_up].reshape(-1)))


@contextmanager
def capture_inputs(model: nn.Module) -> Iterator[UseRecorder]:
    """Record every use of ``model``'s trainable parameters in the torch calls made inside the block.

    >>> with capture_inputs(model) as recorder:
    ...     obj = objective(model, loss_fn, x, y, params)
    >>> blocks = layer_bases(recorder, tau=1.0, executor=SerialExecutor())
    """
    recorder = UseRecorder(*trainable(model))
    with recorder:
        yield recorder


def trainable(model: nn.Module) -> tuple[list[str], list[Tensor]]:
    """Names and tensors of the parameters teleport may move (requires_grad), each once (tied ones too)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [p for _, p in named]
