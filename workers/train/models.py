"""Models built from a ``model`` spec and a dataset's shape: MLP, CNN, ResNet, Transformer.

Teleport may move every weight these models use as a linear map (``nn.Linear``, ``nn.Conv2d``):
``teleport.geometry.capture`` records each use of each parameter in the teleport forward, so
``nn.MultiheadAttention``'s packed projections, tied or shared weights would be moved as well
(``tests/teleport/test_uses.py``). Attention here is four ``nn.Linear`` projections (q, k, v, o)
around ``F.scaled_dot_product_attention``, so the teleport report names each one; teleport runs it
on the math kernel (the fused ones have no double backward), training on the fused ones. LayerNorm
and BatchNorm weights and the Embedding tables (token and position, only looked up) stay exactly as
they are; the report's ``untouched`` says why for each.

Tasks: ``classification`` (logits (B, C)), ``regression`` (predictions (B, output_dim)) and ``lm``
(causal next-token logits (B, T, V), transformer only).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from api_schemas.compat import check_model_data
from api_schemas.spec import CNNModel, CustomModel, MLPModel, ResNetModel, TransformerModel

if TYPE_CHECKING:
    from workers.train.data_bundle import DataBundle

AnyModelSpec = MLPModel | CNNModel | ResNetModel | TransformerModel | CustomModel
TASKS = ("classification", "regression", "lm")


# ----------------------------------------------------------------------------- helpers


def _output_size(kind: str, task: str, num_classes: int | None, output_dim: int | None) -> int:
    """Width of the head: classes for classification, output_dim for regression, vocab for lm."""
    if task == "classification":
        if not num_classes or num_classes < 1:
            raise ValueError(f"model.kind={kind}: a classification dataset must give num_classes >= 1")
        return int(num_classes)
    if task == "regression":
        if not output_dim or output_dim < 1:
            raise ValueError(f"model.kind={kind}: a regression dataset must give output_dim >= 1")
        return int(output_dim)
    if task == "lm":
        if not num_classes or num_classes < 2:
            raise ValueError(f"model.kind={kind}: a language-model dataset must give its vocabulary size")
        return int(num_classes)
    raise ValueError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")


# --------------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """flatten -> (Linear, act)* -> Linear. Symmetry teleport reads ``layers`` and ``negative_slope``."""

    def __init__(self, in_features: int, hidden: list[int], out_features: int, activation: str = "relu",
                 negative_slope: float = 0.1, bias: bool = True) -> None:
        super().__init__()
        widths = [in_features, *hidden, out_features]
        self.layers = nn.ModuleList(
            [nn.Linear(a, b, bias=bias) for a, b in zip(widths[:-1], widths[1:], strict=True)]
        )
        self.activation = activation
        self.negative_slope: float | None = float(negative_slope) if activation == "leaky_relu" else None

    def act(self, h: Tensor) -> Tensor:
        if self.activation == "relu":
            return F.relu(h)
        if self.activation == "leaky_relu":
            assert self.negative_slope is not None
            return F.leaky_relu(h, self.negative_slope)
        if self.activation == "tanh":
            return torch.tanh(h)
        if self.activation == "gelu":
            return F.gelu(h)
        raise ValueError(f"model.activation={self.activation!r} is not one of relu, leaky_relu, tanh, gelu")

    def forward(self, x: Tensor) -> Tensor:
        h = x.flatten(1)  # (B, D)
        for layer in self.layers[:-1]:
            h = self.act(layer(h))  # (B, d_m)
        return self.layers[-1](h)  # (B, out)


def _build_mlp(spec: MLPModel, input_shape: tuple[int, ...], out: int) -> MLP:
    in_features = math.prod(input_shape)
    return MLP(in_features, list(spec.hidden), out, spec.activation, spec.negative_slope, spec.bias)


# --------------------------------------------------------------------------------- CNN


def _image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    c, h, w = (int(s) for s in input_shape)  # (C, H, W): check_model_data has checked the rank
    return c, h, w


class CNN(nn.Module):
    """The paper's CIFAR net: per entry Conv(k, same padding) + ReLU + MaxPool(2), then a Linear head."""

    def __init__(self, in_shape: tuple[int, int, int], channels: list[int], out_features: int,
                 kernel_size: int = 3, pool: bool = True) -> None:
        super().__init__()
        c, h, w = in_shape
        blocks: list[nn.Module] = []
        for width in channels:
            conv = nn.Conv2d(c, width, kernel_size, padding=kernel_size // 2)
            blocks += [conv, nn.ReLU()]
            c = width
            h = h + 2 * (kernel_size // 2) - kernel_size + 1  # same size (odd k) or one more (even k)
            w = w + 2 * (kernel_size // 2) - kernel_size + 1
            if pool and h >= 2 and w >= 2:  # skip pooling once the feature map would drop below 1x1
                blocks.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(c * h * w, out_features)

    def forward(self, x: Tensor) -> Tensor:
        z = self.features(x)  # (B, C_last, h, w)
        return self.head(z.flatten(1))  # (B, out)


# ------------------------------------------------------------------------------ ResNet


def _conv_unit(c_in: int, c_out: int, stride: int, batch_norm: bool) -> list[nn.Module]:
    """3x3 conv (+BatchNorm); the bias is dropped when BatchNorm follows (it would cancel it)."""
    mods: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=not batch_norm)]
    if batch_norm:
        mods.append(nn.BatchNorm2d(c_out))
    return mods


class BasicBlock(nn.Module):
    """conv -> ReLU -> conv, identity skip, then ReLU: two equal-width entries of ``channels``."""

    def __init__(self, width: int, batch_norm: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(*_conv_unit(width, width, 1, batch_norm))
        self.conv2 = nn.Sequential(*_conv_unit(width, width, 1, batch_norm))

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.conv1(x))  # (B, C, H, W)
        return F.relu(x + self.conv2(h))  # (B, C, H, W)


class ResNet(nn.Module):
    """The paper's Tiny-ImageNet net; each entry of ``channels`` is one 3x3 conv layer.

    The first entry is the stem. A wider entry is a stride-2 conv ("larger strides instead of max
    pooling"); the equal-width entries after it pair up into residual basic blocks (an odd one left
    over is a plain conv). The default [64,64,64,128,128,128,256,256,256] thus gives 9 convs with
    3 residual connections, as in the paper. Global average pooling and a Linear head follow.
    """

    def __init__(self, in_shape: tuple[int, int, int], channels: list[int], out_features: int,
                 batch_norm: bool = False) -> None:
        super().__init__()
        c_in, h, w = in_shape
        self.stem = nn.Sequential(*_conv_unit(c_in, channels[0], 1, batch_norm), nn.ReLU())
        stages: list[nn.Module] = []
        prev, i = channels[0], 1
        while i < len(channels):
            width = channels[i]
            if width != prev:  # downsample by stride while the map is at least 2x2
                stride = 2 if min(h, w) >= 2 else 1
                stages += [*_conv_unit(prev, width, stride, batch_norm), nn.ReLU()]
                h, w = (h - 1) // stride + 1, (w - 1) // stride + 1  # 3x3, padding 1
                prev, i = width, i + 1
            elif i + 1 < len(channels) and channels[i + 1] == width:
                stages.append(BasicBlock(width, batch_norm))
                i += 2
            else:
                stages += [*_conv_unit(prev, width, 1, batch_norm), nn.ReLU()]
                i += 1
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(prev, out_features)

    def forward(self, x: Tensor) -> Tensor:
        z = self.stages(self.stem(x))  # (B, C_last, h, w)
        return self.head(z.mean(dim=(2, 3)))  # global average pool (B, C_last) -> (B, out)


# ------------------------------------------------------------------------- Transformer


class Attention(nn.Module):
    """Multi-head self-attention from four Linear layers and scaled_dot_product_attention."""

    def __init__(self, heads: int, head_dim: int, dropout: float = 0.0, causal: bool = False) -> None:
        super().__init__()
        d = heads * head_dim
        self.heads, self.head_dim, self.dropout, self.causal = heads, head_dim, dropout, causal
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape  # (B, T, d)

        def split(z: Tensor) -> Tensor:
            return z.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=self.causal)  # (B, H, T, hd)
        return self.o(a.transpose(1, 2).reshape(b, t, d))  # (B, T, d)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then x + MLP(LN(x)) with a GELU MLP."""

    def __init__(self, heads: int, head_dim: int, mlp_ratio: int, dropout: float, causal: bool) -> None:
        super().__init__()
        d = heads * head_dim
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(heads, head_dim, dropout, causal)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp_ratio * d)
        self.fc2 = nn.Linear(mlp_ratio * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))  # (B, T, d)
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))  # (B, T, d)


class Transformer(nn.Module):
    """Encoder classifier/regressor on (B, T, D_in) floats, or causal LM on (B, T) int64 tokens.

    Input: Linear(D_in, d) (or an Embedding for lm) plus a learned position Embedding(max_len, d);
    then ``layers`` pre-LN blocks and a final LayerNorm. Head: ``pooling`` (mean / last over
    positions, or none for lm) and a Linear to ``out_features``.
    """

    def __init__(self, spec: TransformerModel, task: str, in_features: int | None, out_features: int) -> None:
        super().__init__()
        d = spec.heads * spec.head_dim
        self.task, self.max_len = task, spec.max_len
        self.pooling = spec.pooling or {"classification": "mean", "regression": "last", "lm": "none"}[task]
        if task == "lm":
            self.embed: nn.Module = nn.Embedding(out_features, d)
        else:
            assert in_features is not None
            self.embed = nn.Linear(in_features, d)
        self.pos = nn.Embedding(spec.max_len, d)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(
            [Block(spec.heads, spec.head_dim, spec.mlp_ratio, spec.dropout, causal=task == "lm")
             for _ in range(spec.layers)]
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, out_features)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds model.max_len={self.max_len}: raise model.max_len")
        if self.task == "lm" and x.is_floating_point():
            raise ValueError("a language model takes int64 token ids (B, T), not floats")
        positions = torch.arange(t, device=x.device)  # (T,)
        h = self.drop(self.embed(x) + self.pos(positions))  # (B, T, d)
        for block in self.blocks:
            h = block(h)  # (B, T, d)
        h = self.norm(h)  # (B, T, d)
        if self.pooling == "mean":
            h = h.mean(dim=1)  # (B, d)
        elif self.pooling == "last":
            h = h[:, -1]  # (B, d)
        return self.head(h)  # (B, out) or (B, T, V) for lm


def _build_transformer(spec: TransformerModel, task: str, input_shape: tuple[int, ...], out: int) -> Transformer:
    in_features = None if task == "lm" else int(input_shape[1])  # tokens (T,) or sequences (T, D)
    return Transformer(spec, task, in_features, out)


# ---------------------------------------------------------------------------- builders


def build_model(spec: AnyModelSpec, *, task: str, input_shape: tuple[int, ...], num_classes: int | None,
                output_dim: int | None, dataset: str | None = None) -> nn.Module:
    """The model for ``spec`` on data of ``input_shape`` (per sample, no batch dim) and ``task``.

    Raises ValueError naming the spec field to change when the model cannot take the data.
    """
    if isinstance(spec, CustomModel):
        return build_custom_model(spec)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")
    input_shape = tuple(int(s) for s in input_shape)
    out = _output_size(spec.kind, task, num_classes, output_dim)
    check_model_data(spec, task, input_shape, dataset)  # the rule the service also applies at submit
    if isinstance(spec, MLPModel):
        return _build_mlp(spec, input_shape, out)
    if isinstance(spec, CNNModel):
        return CNN(_image_shape(input_shape), list(spec.channels), out, spec.kernel_size, spec.pool)
    if isinstance(spec, ResNetModel):
        return ResNet(_image_shape(input_shape), list(spec.channels), out, spec.batch_norm)
    if isinstance(spec, TransformerModel):
        return _build_transformer(spec, task, input_shape, out)
    kind = getattr(spec, "kind", spec)
    raise ValueError(f"model.kind={kind!r} is not one of mlp, cnn, resnet, transformer")


def build_custom_model(spec: CustomModel) -> nn.Module:
    """``model.factory(**model.args)``, which must return a ``torch.nn.Module``."""
    from workers.train.user_code import UserCodeError, call, definition, resolve

    model = call(spec.factory, "model.factory", spec.args)
    if not isinstance(model, nn.Module):
        where = definition(resolve(spec.factory, "model.factory"))
        raise UserCodeError(f"{where + ': ' if where else ''}model.factory {spec.factory} returned a "
                            f"{type(model).__name__}, not a torch.nn.Module: return the model itself")
    model.register_forward_hook(logits_output)
    return model


def logits_output(module: nn.Module, args: Any, output: Any) -> Tensor | None:
    """A forward hook: a model that answers with an object holding ``logits`` (a Hugging Face ``ModelOutput``) is
    read as its logits, which the losses, the evaluation and teleport take; any other output is kept (None)."""
    logits = getattr(output, "logits", None)
    return logits if not isinstance(output, Tensor) and isinstance(logits, Tensor) else None


def build_model_for(spec: AnyModelSpec, data: DataBundle) -> nn.Module:
    """``build_model`` with the task and shapes read from a dataset bundle."""
    return build_model(spec, task=data.task, input_shape=tuple(data.input_shape),
                       num_classes=data.num_classes, output_dim=data.output_dim,
                       dataset=getattr(data, "name", None))


# ------------------------------------------------------------------------------ losses


def classification_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy: logits (B, C), target (B,) int64."""
    return F.cross_entropy(logits, target)


def regression_loss(pred: Tensor, target: Tensor) -> Tensor:
    """Mean squared error: pred (B, D), target (B, D) (a (B,) target matches a (B, 1) prediction)."""
    if pred.shape != target.shape and pred.numel() == target.numel():
        target = target.reshape(pred.shape)
    return F.mse_loss(pred, target)


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), target (B, T) int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))  # (B*T, V) vs (B*T,)


def cross_entropy_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy over every target: logits (..., C) with target (...), e.g. (B, C) with (B,) or
    (B, T, V) with (B, T); otherwise PyTorch's own layout (classes in dim 1, as (B, C, H, W) with (B, H, W))."""
    if logits.dim() == target.dim() + 1 and logits.shape[:-1] == target.shape:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return F.cross_entropy(logits, target)


BUILTIN_LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"cross_entropy": cross_entropy_loss,
                                                                 "mse": regression_loss}


def loss_fn_for(task: str, loss: str | None = None) -> Callable[[Tensor, Tensor], Tensor]:
    """``training.loss`` (a built-in name or ``pkg.module:function``), else the task's own loss (cross-entropy
    for integer targets, mean squared error for float ones). Module-level functions, so they pickle for Ray."""
    if loss in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[loss]
    if loss:
        from workers.train.user_code import resolve

        return resolve(loss, "training.loss")
    losses = {"classification": classification_loss, "regression": regression_loss, "lm": lm_loss}
    if task not in losses:
        raise ValueError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")
    return losses[task]
