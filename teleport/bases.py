"""Step 2: bases of each layer's input space by SVD with the τ rule (paper eq. 3), and the projection π.

eq. 3:   k = min { k : ‖R_k‖²_F ≥ τ ‖R‖²_F },   ‖R_k‖²_F = σ_1² + ... + σ_k²

The first k left singular vectors B = [u_1 .. u_k] span the "core" input space; the teleport
update is projected onto its orthogonal complement (paper eqs. 12-17):

    π(G) = G − (G B) Bᵀ          (G laid out as (C_o, d), rows of R are d)

which is the paper's MLP form; its conv/attention forms ``G − B Bᵀ G`` are the same operator on
the transposed layout. When the complement N is the smaller side, π(G) = (G N) Nᵀ instead.
Two readings of τ (``tau_rule``):
- ``numerical_rank`` (default): eq. 3 in float64, never keeping fewer directions than the
  numerical rank σ_i > max(d, N)·eps·σ_1 (the rule ``torch.linalg.matrix_rank`` uses). τ = 1 is
  exact: conv layers whose C·k·k ≤ n·h·w then have no free direction.
- ``energy``: eq. 3 as written, the cumulative energy summed in the model's precision (float32 at
  least). At τ = 1 the partial sum reaches the total once the tail is below its round-off, so that
  negligible tail counts as captured and its directions are freed (the paper's CNN gains at τ = 1).
Decompositions run in float64 (thin SVD of R, or eigh of its float64 Gram) and the bases are kept
in float32 at least, whatever R's dtype: bf16's eps would call 0.5·σ_1 noise and free directions
that are not null. Why float64 for the SVD: π(G) = G − (G K) Kᵀ cancels most of G (the teleport
gradient lies mostly in the inputs' span), so K's loss of orthogonality leaks back into the span
amplified by |G K|/|π(G)|. A float32 thin SVD's K is orthogonal to ~1.5e-6: 1.8e-4 batch-loss drift
on the digits MLP preset; from a float64 SVD, ~3e-5. (Projecting twice in float32 reaches 4e-7 but
adds ~20 % to every step of a [1024, 1024] MLP on CPU; the float64 SVD costs once per batch.)

Two routes, picked by shape (both return the same subspace):
- ``svd``:  thin SVD of R (d, N) when N < d — O(d N²);
- ``gram``: eigh of R Rᵀ (d, d), accumulated in float64, when N ≥ d — O(d² N + d³).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")
U = TypeVar("U")


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


def tau_rank(sq_singular: Tensor, tau: float, rank_tol: float) -> int:
    """eq. 3 on descending σ²: the smallest k whose head holds τ of ‖R‖²_F, within the numerical rank."""
    numerical = int((sq_singular > rank_tol).sum())
    if tau >= 1.0 or numerical == 0:
        return numerical
    energy = torch.cumsum(sq_singular, 0)
    k = int(torch.searchsorted(energy, tau * energy[-1]).item()) + 1
    return min(k, numerical)


def energy_rank(sq_singular: Tensor, tau: float, dtype: torch.dtype) -> int:
    """eq. 3 as written, min { k : σ_1² + ... + σ_k² ≥ τ ‖R‖²_F }, the sums in ``dtype``."""
    energy = torch.cumsum(sq_singular.to(dtype), 0)
    return min(int((energy < tau * energy[-1]).sum()) + 1, sq_singular.numel())


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Bases are computed in float32 at least: bf16/fp16 R is promoted."""
    return torch.promote_types(dtype, torch.float32)


def _rank_tol(sq_max: float, shape: tuple[int, int], dtype: torch.dtype) -> float:
    """σ² threshold of the numerical rank: (max(d, N)·eps·σ_max)², eps of R's dtype."""
    return (max(shape) * torch.finfo(dtype).eps) ** 2 * sq_max


@dataclass(frozen=True)
class Spectrum:
    """σ² of R (descending, float64) and the matching left singular vectors, (d, m) in R's dtype."""

    sq: Tensor
    vectors: Tensor
    cols: int  # N, the number of columns of R (over all ranks when distributed)
    route: str
    source: torch.dtype = torch.float32  # R's own dtype: the precision of the energy rule


def spectrum_of_gram(gram: Tensor, cols: int, dtype: torch.dtype) -> Spectrum:
    """eigh of R Rᵀ (d, d), float64: σ² = eigenvalues, the eigenvectors are R's left singular vectors."""
    lam, vecs = torch.linalg.eigh(gram)  # ascending; (d,), (d, d)
    return Spectrum(lam.flip(0).clamp_min(0), vecs.flip(1).to(working_dtype(dtype)), cols, "gram", dtype)


def gram(rep: Tensor) -> Tensor:
    r64 = rep.double()
    return r64 @ r64.T  # (d, d)


def spectrum(rep: Tensor) -> Spectrum:
    """The cheaper route for R's shape: thin SVD when N < d, else the Gram matrix's eigh."""
    d, n = rep.shape
    if n < d:  # in float64: a float32 SVD's vectors are orthogonal to ~1e-6 only (see module docstring)
        u, s, _ = torch.linalg.svd(rep.double(), full_matrices=False)  # u: (d, N), s: (N,)
        return Spectrum(s**2, u.to(working_dtype(rep.dtype)), n, "svd", rep.dtype)
    return spectrum_of_gram(gram(rep), n, rep.dtype)


def select_basis(spec: Spectrum, tau: float, rule: str = "numerical_rank") -> Basis:
    """Apply eq. 3 (and the numerical rank) to a spectrum; keep the smaller of span and complement."""
    vectors, sq = spec.vectors, spec.sq
    d = vectors.shape[0]
    total = float(sq.sum())
    if total == 0.0:  # an all-zero input: nothing to keep, every direction is free
        return Basis(d, 0, 1.0, None, torch.eye(d, dtype=vectors.dtype, device=vectors.device), spec.route)
    tol = _rank_tol(float(sq[0]), (d, spec.cols), vectors.dtype)
    if spec.route == "gram":  # eigenvalues of a float64 Gram carry ~max(d, N)·eps64·λ_max of round-off
        tol = max(tol, max(d, spec.cols) * torch.finfo(torch.float64).eps * float(sq[0]))
    k = tau_rank(sq, tau, tol) if rule == "numerical_rank" else energy_rank(sq, tau, working_dtype(spec.source))
    captured = float(sq[:k].sum()) / total
    free = vectors[:, k:].contiguous() if spec.route == "gram" else None
    # keep only the smaller side; projecting with it costs 2·C_o·d·min(k, d−k)
    if free is not None and free.shape[1] <= k:
        return Basis(d, k, captured, None, free, spec.route)
    return Basis(d, k, captured, vectors[:, :k].contiguous(), None, spec.route)


def compute_basis(rep: Tensor, tau: float = 1.0, rule: str = "numerical_rank") -> Basis:
    """SVD of R (d, N) with the τ rule, by the cheaper route for its shape."""
    return select_basis(spectrum(rep), tau, rule)


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


# ------------------------------------------------------------------ executors


class BasisExecutor(Protocol):
    """Runs ``compute_basis`` over every layer's R; workers plug in Ray tasks or a GPU batch."""

    def map(self, fn: Callable[[T], U], items: Sequence[T]) -> list[U]: ...


class SerialExecutor:
    """One layer after another, in this process (the default)."""

    def map(self, fn: Callable[[T], U], items: Sequence[T]) -> list[U]:
        return [fn(item) for item in items]


class ThreadExecutor:
    """Layers on a thread pool: torch's SVD/eigh release the GIL.

    Each decomposition runs single-threaded while the pool is busy (torch's thread count is
    process-wide): k BLAS-threaded SVDs on k cores oversubscribe them and run 10-20x slower.
    Representations on a GPU are decomposed one after another in the calling thread: the device runs
    them in turn anyway, and a pool thread has no current CUDA context (cuBLAS warns and sets one up).
    """

    def __init__(self, max_workers: int | None = None) -> None:
        self.max_workers = max_workers  # None: torch's thread budget of this process (a worker's CPUs)

    def map(self, fn: Callable[[T], U], items: Sequence[T]) -> list[U]:
        threads = torch.get_num_threads()
        workers = self.max_workers or threads
        on_gpu = any(isinstance(item, Tensor) and item.device.type != "cpu" for item in items)
        if len(items) <= 1 or workers <= 1 or on_gpu:
            return [fn(item) for item in items]
        try:  # OpenMP's thread count is per calling thread: set it in each pool thread too
            with ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
                return list(pool.map(fn, items))
        finally:
            torch.set_num_threads(threads)
