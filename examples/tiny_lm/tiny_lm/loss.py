"""The loss: mean next-token cross-entropy over every position (logits (B, T, V), targets (B, T))."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def next_token(logits: Tensor, targets: Tensor) -> Tensor:
    """``training: {loss: "tiny_lm.loss:next_token"}``: any function (prediction, target) -> scalar works."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
