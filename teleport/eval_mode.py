"""A teleport computes with its model in eval mode, and leaves every module in the mode it found it in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


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
