"""The device ascent's move in a few kernels a run of weights, not five a weight (``teleport.ascent.device``).

A tick moves every moving weight the same way: W₀ := W where a step starts, U := the new direction there, then
W := W₀ + η·U for a try, W₀ when every try failed, else W as it is — each a ``torch.where`` on a 0-d condition.
Per weight that is five kernels; a GPT-style LM has ~30 moving weights (4 blocks), so ~150 of a tick's ~1,100
(``benchmarks/lm_payoff``, counted on the CPU), each a launch eagerly and a node of a captured graph.

Here W₀ and U live in flat buffers, one per *run* (weights of one dtype and device, at most ``CHUNK`` elements
together), every weight's W₀ and U a view into them. A move copies the run's weights into a scratch buffer (one
multi-tensor ``_foreach_copy_``), does the four ``where``/``addcmul`` on the flat buffers, and copies back: seven
kernels a run whatever its number of weights. ``where`` chooses exactly (no 0·NaN), as before; the values are
the same bits. Extra memory: two scratch buffers of the largest run (``CHUNK`` bounds them: 64 Mi elements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from teleport.modes import in_dtypes

CHUNK = 1 << 26  # elements in one run at most: the scratch buffers' size for a model with more moving weights


def _runs(weights: list[Tensor]) -> list[list[int]]:
    """Indices of ``weights`` grouped by (dtype, device), a group split where it would pass ``CHUNK`` elements."""
    runs: list[list[int]] = []
    open_run: dict[tuple, tuple[list[int], int]] = {}  # (dtype, device) -> (the run being filled, its elements)
    for i, w in enumerate(weights):
        group = (w.dtype, w.device)
        run, size = open_run.get(group, (None, 0))
        if run is None or size + w.numel() > CHUNK:
            run, size = [], 0
            runs.append(run)
        run.append(i)
        open_run[group] = (run, size + w.numel())
    return runs


def _views(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    """Views of the start of ``flat`` shaped as ``like``, back to back."""
    sizes = [t.numel() for t in like]
    return [v.view(t.shape) for v, t in zip(flat[: sum(sizes)].split(sizes), like, strict=True)]


@dataclass
class _Run:
    weights: list[Tensor]
    origin: Tensor  # W₀ of the run's weights, flat
    u: Tensor  # U, flat
    here: Tensor  # scratch: W, then the weights after the move
    new: Tensor  # scratch: the new U, then the try W₀ + η·U
    here_views: list[Tensor]  # ``here`` shaped as the weights
    new_views: list[Tensor]


class FlatMove:
    """W₀ and U of the moving weights in flat runs, and the move of a tick on them (see the module)."""

    def __init__(self, weights: list[Tensor]) -> None:
        self.weights = weights
        self.runs = _runs(weights)
        self.origin: list[Tensor] = [torch.empty(0)] * len(weights)  # W₀ of the step in flight, a view each
        self.u: list[Tensor] = [torch.empty(0)] * len(weights)  # its U = π(H·∇L)
        widest: dict[tuple, int] = {}
        for run in self.runs:
            w = weights[run[0]]
            group = (w.dtype, w.device)
            widest[group] = max(widest.get(group, 0), sum(weights[i].numel() for i in run))
        scratch = {g: (torch.empty(n, dtype=g[0], device=g[1]), torch.empty(n, dtype=g[0], device=g[1]))
                   for g, n in widest.items()}
        self.flat: list[_Run] = []
        with torch.no_grad():
            for run in self.runs:
                ws = [weights[i] for i in run]
                n, w = sum(t.numel() for t in ws), ws[0]
                here, new = scratch[(w.dtype, w.device)]
                flat = _Run(ws, torch.empty(n, dtype=w.dtype, device=w.device),
                            torch.zeros(n, dtype=w.dtype, device=w.device), here[:n], new[:n],
                            _views(here, ws), _views(new, ws))
                self.flat.append(flat)
                for i, o, d in zip(run, _views(flat.origin, ws), _views(flat.u, ws), strict=True):
                    self.origin[i], self.u[i] = o, d

    def move(self, start: Tensor, retry: Tensor, exhausted: Tensor, eta_try: Tensor, u_new: list[Tensor]) -> None:
        """W₀ := W and U := ``u_new`` where ``start``; then W := W₀ + η·U where ``start | retry``, W₀ where
        ``exhausted``, else W unchanged. ``u_new`` may be ``self.u`` (no new direction: the last step's tries)."""
        move = start | retry
        etas = in_dtypes(eta_try, self.weights)
        with torch.no_grad():
            for run, r in zip(self.runs, self.flat, strict=True):
                torch._foreach_copy_(r.here_views, r.weights)
                torch.where(start, r.here, r.origin, out=r.origin)
                if u_new is not self.u:
                    torch._foreach_copy_(r.new_views, [u_new[i] for i in run])
                    torch.where(start, r.new, r.u, out=r.u)
                torch.where(exhausted, r.origin, r.here, out=r.here)
                torch.addcmul(r.origin, r.u, etas[r.origin.dtype], out=r.new)
                torch.where(move, r.new, r.here, out=r.here)
                torch._foreach_copy_(r.weights, r.here_views)
