"""The modes a teleport computes in: the model in eval mode, float32 in full IEEE precision (no TF32).

A teleport computes with its model in eval mode (no dropout, batch norm on its running statistics: the loss a
teleport keeps is a function of the weights alone) and leaves every module in the mode it found it in.

On Ampere and later GPUs cuDNN convolutions use TF32 by default (10-bit mantissa, ~1e-3 relative), and
many training scripts turn it on for matmuls too. The null-space projection cancels most of the teleport
gradient and the batch loss must stay to ~1e-6: a TF32 forward would move it by ~1e-3. The flags are
set through PyTorch's per-backend ``fp32_precision`` API (mixing it with the legacy ``allow_tf32`` flags
raises in PyTorch ≥ 2.9) and restored afterwards. On a CPU this changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_BACKENDS = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """float32 matmuls and convolutions in IEEE precision (no TF32) inside; the caller's setting after."""
    saved = [(b, b.fp32_precision) for b in _BACKENDS if hasattr(b, "fp32_precision")]
    try:
        for backend, _ in saved:
            backend.fp32_precision = "ieee"
        yield
    finally:
        for backend, value in saved:
            backend.fp32_precision = value


def in_dtypes(scalar: torch.Tensor, like: list[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """A 0-d tensor in each dtype of ``like``, converted once (not once per tensor: a kernel each on a GPU)."""
    return {dtype: scalar.to(dtype) for dtype in {t.dtype for t in like}}


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` inside (no dropout, batch norm on its running statistics: the loss a teleport keeps is a
    function of the weights alone); after, every module back in its own mode — not ``model.train(was)``, which puts
    a batch norm that a training model keeps frozen (in eval mode, as fine-tuning does) back in training mode."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            if module.training != training:
                module.training = training
