"""Full float32 for the teleport: TensorFloat-32 off while it runs, whatever the caller's training uses.

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
