"""π, the projection of a teleport gradient onto the null space of a layer's inputs (paper eqs. 12-17), and the
``Basis`` it projects with (``teleport.geometry.bases`` computes it):

    π(G) = G − (G B) Bᵀ          (G laid out as (C_o, d), rows of R are d; B the kept span, orthonormal)

or π(G) = (G N) Nᵀ with the complement N, when that is the smaller side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Basis:
    """Orthonormal bases of one representation's kept span (d, k) and/or its complement (d, d−k).

    Only the smaller of the two is needed to project; the thin-SVD route has only ``kept``.
    """

    dim: int
    rank: int
    captured_variance: float  # ‖R_k‖²_F / ‖R‖²_F
    kept: Tensor | None
    free: Tensor | None
    route: str

    @property
    def free_dims(self) -> int:
        return self.dim - self.rank


def project(grad: Tensor, basis: Basis, inplace: bool = False) -> Tensor:
    """π(G) for G laid out (C_o, d): remove the part of each row inside the kept input span.

    ``inplace``: G may be overwritten (a fresh gradient): no copy of it (a step of an MLP [1024, 1024]
    spent ~1.7 ms of its ~16 ms copying G into addmm's output)."""
    if basis.free is not None:
        return (grad @ basis.free) @ basis.free.T  # (C_o, d−k) @ (d−k, d)
    if basis.kept is None or basis.rank == 0:
        return grad
    c = grad @ basis.kept  # (C_o, k)
    return grad.addmm_(c, basis.kept.T, alpha=-1) if inplace else torch.addmm(grad, c, basis.kept.T, alpha=-1)


def project_split(gw: Tensor, gb: Tensor | None, basis: Basis, inplace: bool = False) -> tuple[Tensor, Tensor | None]:
    """π([∇W | ∇b]) without building the (C_o, d+1) concatenation: the basis' last row is the bias's.

    Same operator as ``project`` on ``cat([gw, gb[:, None]], 1)``, with fewer passes over the weights
    (which dominate a step of a wide MLP). ``inplace``: gw and gb may be overwritten (see ``project``).
    """
    if gb is None:
        return project(gw, basis, inplace), None
    d = gw.shape[1]
    if basis.free is not None:
        f = basis.free
        c = torch.addr(gw @ f[:d], gb, f[d])  # (C_o, d+1−k): coordinates in the free space
        return c @ f[:d].T, c @ f[d]
    if basis.kept is None or basis.rank == 0:
        return gw, gb
    k = basis.kept
    c = torch.addr(gw @ k[:d], gb, k[d])  # (C_o, k): the part inside the kept span
    if inplace:
        return gw.addmm_(c, k[:d].T, alpha=-1), gb.addmv_(c, k[d], alpha=-1)
    return torch.addmm(gw, c, k[:d].T, alpha=-1), torch.addmv(gb, c, k[d], alpha=-1)
