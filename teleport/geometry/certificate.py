"""A full numerical rank proven without eigenvalues, for the bases' default τ rule.

At τ = 1 the ``numerical_rank`` rule keeps every direction of R whose σ² is above ``rel_tol``·σ²_max
(``bases._relative_tol``). When even the smallest is above it, R keeps its whole span and its spectrum is not
needed: the usual case of a teleport batch with fewer tokens than a layer has inputs (N < d, the ``cols`` route: R's
own columns, made orthonormal, are the basis), and of a convolution whose patches span all its inputs (N ≥ d, the
``gram`` route: no free direction). With the Cholesky factor of the float64 Gram G = L Lᵀ (n × n, n = min(d, N)):

    λ_min(G) = 1 / ‖L⁻¹‖²₂ ≥ 1 / min(‖L⁻¹‖²_F, ‖L⁻¹‖₁‖L⁻¹‖_∞)     (‖L⁻¹‖²_F = trace(G⁻¹), within n of 1/λ_min)
    λ_max(G) = ‖G‖₂ ≤ min(‖G‖_F, ‖G‖₁)                            (‖G‖_F within √n of λ_max)

so lower > ``MARGIN``·rel_tol·upper proves rank n. The bounds are loose by at most n^1.5, and tighten where it
matters (a spread spectrum: its few smallest λ dominate trace(G⁻¹), its largest ‖G‖_F): an R within that
factor of the threshold (or of lower rank: Cholesky fails) is left to the eigenvalues, whose answer is then the same
as before. ``MARGIN`` covers the round-off of G, L and L⁻¹ (relative ~n·ε₆₄·κ(G): below 1e-5 for a float32 R that
passes; for a float64 R up to the n·ε₆₄ term of the rule's tolerance, which the eigenvalues of a float64 Gram carry
too).

Why: on CUDA, torch's eigh/eigvalsh of a batch of matrices larger than 32 × 32 loops over cuSOLVER's ``syevd``
one matrix at a time (pytorch issues 174674 and 175585: 1.8 ms a 100 × 100 matrix,
8 ms for 500 of them in CuPy's batched call), and a GPT-style LM's teleport batch has 17 Grams of 256 × 256.
Cholesky and the triangular inverse run batched without a sync, and L⁻¹ is also CholeskyQR2's first pass, as a
matrix product (``bases.whole_spans``). On the CPU the certificate of those 17 Grams takes 32 ms where their
eigenvalues took 43 ms (1 thread; ``benchmarks.lm_setup``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

MARGIN = 2.0  # the proven lower bound must clear the rank threshold by this factor (round-off of G, L and L⁻¹)
RETRY = 8  # teleport batches an R the certificate did not prove goes to the eigenvalues before it is tried again


def certify_full_rank(gram: Tensor, rel_tol: Tensor | float) -> tuple[Tensor, Tensor, Tensor]:
    """(ok, condition, L⁻¹) for float64 Grams (b, n, n): ``ok`` (b,) where λ_min > rel_tol·λ_max is proven (see the
    module), ``condition`` (b,) the bound's upper / lower ≥ κ(G), L⁻¹ (b, n, n) the inverse of each Cholesky factor
    (meaningless where not ``ok``). No host sync: ``cholesky_ex`` reports a failed factorization in ``info`` rather
    than raising, and a singular factor makes ‖L⁻¹‖ infinite."""
    chol, info = torch.linalg.cholesky_ex(gram)
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device).expand_as(gram)
    inverse = torch.linalg.solve_triangular(chol, eye, upper=False)
    inverse_sq = torch.minimum(inverse.square().sum((-2, -1)),  # ‖L⁻¹‖²_F ≥ ‖L⁻¹‖²₂ = 1/λ_min
                               _norm(inverse, 1) * _norm(inverse, float("inf")))  # ‖L⁻¹‖₁‖L⁻¹‖_∞ ≥ ‖L⁻¹‖²₂
    upper = torch.minimum(torch.linalg.matrix_norm(gram), _norm(gram, 1))  # ≥ λ_max: Frobenius, max column sum
    condition = upper * inverse_sq  # upper / lower
    ok = (info == 0) & torch.isfinite(condition) & (condition * rel_tol * MARGIN < 1)
    return ok, condition, inverse


def without_duplicates(stack: Tensor, gram: Tensor) -> tuple[Tensor, Tensor]:
    """(G', duplicate) for R (b, d, N) and its float64 Gram G: ``duplicate`` (b, N) bool, a column that repeats an
    earlier one; G' the Gram of R' — R with those columns zeroed, the same span — but for their diagonal entries,
    max_i G_ii (an eigenvalue within [λ_max/N, λ_max], clear of the rank threshold, their rows and columns zero). The
    certificate of G' proves the rank of R to be N minus the duplicates, and R' L'⁻ᵀ is an orthonormal basis of R's
    span with a zero column in each duplicate's place (the width a captured tick keeps).

    An LM's teleport batch repeats columns: the same token at the same position of two sequences is one column twice
    in block 0's inputs, the same first token (a BOS token) in every block's; each such R went to the eigenvalues.
    Equal columns are found by two hashes of their float64 bits — integer sums of the bits' high 31 and low 33 bits
    times fixed odd numbers, which no order of summing changes (no overflow below 2^14 inputs; past it they wrap,
    alike for equal columns), so equal columns hash alike wherever they sit, which a float projection does not
    promise (a BLAS product rounds an edge column otherwise, measured) — and every candidate is compared with the
    earlier column it matched, value for value, so a collision drops nothing. A column equal to another only within
    rounding is no repeat here: its R goes to the eigenvalues."""
    bits = stack.view(torch.int64)  # (b, d, N), float64 R: a column's bits
    odd = (2 * torch.arange(bits.shape[-2], dtype=torch.int64, device=stack.device) + 1)[:, None]
    hashes = torch.stack([((bits >> 33) * odd).sum(-2), ((bits & (2**33 - 1)) * odd).sum(-2)], -2)  # (b, 2, N)
    order = torch.arange(bits.shape[-1], device=stack.device)
    same = (hashes[..., :, None] == hashes[..., None, :]).all(-3) & (order[:, None] > order)  # (b, N, N): j's, an i < j
    first = same.to(torch.uint8).argmax(-1)  # (b, N): the first such i (0 where none)
    earlier = stack.gather(-1, first[..., None, :].expand_as(stack))
    duplicate = same.any(-1) & (earlier == stack).all(-2)  # column j equals column i < j
    keep = (~duplicate).to(gram.dtype)
    fill = duplicate.to(gram.dtype) * gram.diagonal(dim1=-2, dim2=-1).amax(-1, keepdim=True)
    return gram * keep[..., :, None] * keep[..., None, :] + torch.diag_embed(fill), duplicate


def _norm(matrices: Tensor, ord: float) -> Tensor:
    """The induced 1-norm (max column sum) or ∞-norm (max row sum) of each matrix of a batch."""
    return torch.linalg.matrix_norm(matrices, ord=ord)


ProofKey = tuple[int, tuple[int, ...], torch.dtype, torch.device]  # an R's place in its batch's list, its kind


class Proofs:
    """What the certificate made of one model's R, batch after batch (a model's ``Teleporter`` keeps one).

    A model in training has R of lower rank (the GPT-style LM of ``benchmarks.lm_trained``: 0-2 of its 17 R proven
    after 150 AdamW steps, every batch alike), and a certificate that fails is all cost: 38 ms of that LM's 648 ms
    teleport on the CPU. So an R it did not prove goes straight to the eigenvalues for the next ``RETRY`` batches —
    whose answer is the one the certificate would have given wherever it proves (``bases.compute_bases``), so only
    speed can be lost, bounded by the retry — and is tried again after them. An R is known by its place in the
    batch's list of representations (the model's forward order), its shape, dtype and device: a batch of another
    shape is a new R."""

    def __init__(self) -> None:
        self._skip: dict[ProofKey, int] = {}  # an R not proven -> the batches left before it is tried again

    def state_dict(self) -> list[list]:
        return [[i, list(shape), str(dtype).removeprefix("torch."), str(device), left]
                for (i, shape, dtype, device), left in self._skip.items()]

    def load_state_dict(self, state: list[list]) -> None:
        self._skip = {(i, tuple(shape), getattr(torch, dtype), torch.device(device)): left
                      for i, shape, dtype, device, left in state}

    @staticmethod
    def key(i: int, rep: Tensor) -> ProofKey:
        return i, tuple(rep.shape), rep.dtype, rep.device

    def worth(self, reps: Sequence[Tensor]) -> list[int]:
        """The indices of the R worth the certificate this batch (each skipped one counts a batch down)."""
        tried = []
        for i, rep in enumerate(reps):
            k = self.key(i, rep)
            left = self._skip.get(k, 0)
            if left > 0:
                self._skip[k] = left - 1
            else:
                tried.append(i)
        return tried

    def record(self, reps: Sequence[Tensor], tried: list[int], proven: set[int]) -> None:
        """The certificate's verdicts on the ``tried`` R: a failure skips the R for ``RETRY`` batches."""
        for i in tried:
            k = self.key(i, reps[i])
            if i in proven:
                self._skip.pop(k, None)
            else:
                self._skip[k] = RETRY
