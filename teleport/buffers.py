"""The moving weights of one teleport and a spare buffer for each: steps without copying the weights.

A step tries W = W₀ + η·U and, when the guard refuses it, shorter ones from the same W₀, or puts W₀
back. Keeping W₀ by copying the weights before every step costs two passes over them (a read and a
write: ~0.5× a forward+backward of an MLP [1024, 1024] at n = 32, where every pass over the 1.9 M
weights counts). Instead each weight has a spare buffer of its shape: a try writes W₀ + η·U into the
spare and swaps the storages (``p.data = spare``), so W₀ stays where it was, untouched. Accepting
the step makes W₀'s buffer the next spare; refusing every try swaps W₀ back. Bit-identical to the
copy: the same ``torch.add(W₀, U, alpha=η)`` writes the same values, and nothing is added twice.

``finish`` puts every parameter back into its own storage (one copy, when it ended in the spare),
so whoever holds the parameter or a view of its storage (an optimizer, DDP, a flat buffer) sees
the teleported values in the place it knows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from teleport.precision import in_dtypes


class StepBuffers:
    """Two storages per moving weight: the one the parameter holds now, and a spare."""

    def __init__(self, weights: list[Tensor]) -> None:
        self.weights = weights
        self.home = [w.data for w in weights]  # the parameters' own storage, where they end
        self.spare = [torch.empty_like(w) for w in weights]
        self.origin: list[Tensor] | None = None  # W₀ of the step being tried (not the parameters' storage)

    def move(self, direction: list[Tensor], eta: float | Tensor) -> None:
        """W = W₀ + η·U, W₀ being the weights when this step's first try began; η a number or a 0-d tensor
        on the weights' device (decided there: no host sync)."""
        with torch.no_grad():
            if self.origin is None:  # first try of a step: the spare takes W₀ + ηU, W₀ stays put
                self.origin = [w.data for w in self.weights]
                for w, s in zip(self.weights, self.spare, strict=True):
                    w.data = s
            etas = in_dtypes(eta, direction) if isinstance(eta, Tensor) else {}
            for w, w0, u in zip(self.weights, self.origin, direction, strict=True):
                if isinstance(eta, Tensor):
                    torch.addcmul(w0, u, etas[u.dtype], out=w)
                else:
                    torch.add(w0, u, alpha=eta, out=w)

    def restore(self) -> None:
        """Back to W₀ (no try of this step is kept)."""
        if self.origin is None:
            return
        tried = [w.data for w in self.weights]
        for w, w0 in zip(self.weights, self.origin, strict=True):
            w.data = w0
        self.spare, self.origin = tried, None

    def accept(self) -> None:
        """Keep the last try: W₀'s storage is the next step's spare."""
        if self.origin is not None:
            self.spare, self.origin = self.origin, None

    def finish(self) -> None:
        """Every parameter back in its own storage, holding the last accepted values (a try still in
        flight, when an error cut the step short, is dropped)."""
        self.restore()
        with torch.no_grad():
            for w, home in zip(self.weights, self.home, strict=True):
                if w.data_ptr() != home.data_ptr():
                    home.copy_(w.data)
                    w.data = home
        self.spare, self.origin = [], None
