"""Step 2: bases of each layer's input space by SVD with the τ rule (paper eq. 3); π projects with them
(``teleport.geometry.projection``).

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

Three routes, all in float64, all returning the same subspace:
- ``gram``: eigh of R Rᵀ (d, d) when N ≥ d — O(d² N + d³);
- ``cols``: eigh of Rᵀ R (N, N) when N < d — O(d N² + N³): U = R V Σ⁻¹ for the kept σ, made orthonormal
  again by CholeskyQR2 (two passes of U ← U L⁻ᵀ, L Lᵀ = UᵀU), since R V Σ⁻¹ loses orthogonality as
  ε·σ₁²/σ_k² for small kept σ_k; an R of rank N keeps its own span, CholeskyQR2 of R itself (no R V).
  The default for N < d: a GPU's thin SVD of (d, N) is cuSOLVER's unblocked QR (88 % of a GPT teleport's GPU
  time on an H100); on 1 CPU thread the eigh is 1.2-1.5x faster than the SVD (d = 512-2048, N = 256).
  A GPU's eigh of N = 256 is no quick thing either (cuSOLVER's syevd, one matrix after another: 34 ms for the
  GPT-style LM's 17 Grams on an H200), so ``teleport.geometry.eigh_route`` runs it on the device or on the host's cores,
  one Gram a thread, whichever it measured faster.
- ``svd``: thin SVD of R (d, N), N < d — O(d N²): ask for it by name (``compute_basis(..., route="svd")``);
  the distributed path uses it for gathered columns.
``spectra`` decomposes a list of R at once: R of equal shape (a transformer's blocks) in one batched eigh,
and every σ² comes to the host in one copy, so the τ rule costs one host sync per teleport, not per layer;
``compute_bases`` then makes the kept vectors of equal (d, k) orthonormal in one batched CholeskyQR2 (the GPT-style
LM's evaluation + bases: 776 -> 641 kernels, CPU count, ``benchmarks/lm_payoff``).
At τ = 1 by the numerical rank (the default), before any of these: an R whose full rank
``teleport.geometry.certificate`` proves from a Cholesky factor keeps its whole span with no eigenvalue computed
(``whole_spans``); the routes above decompose the others (of lower rank, as a rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from teleport.geometry.certificate import Proofs, certify_full_rank, without_duplicates
from teleport.geometry.eigh_route import EighRoutes, eigh
from teleport.geometry.projection import Basis

ONE_PASS = 1e-2  # CholeskyQR's first pass is enough when its ε₆₄·κ(G) is this far below the basis dtype's ε


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


def _relative_tol(shape: tuple[int, int], dtype: torch.dtype, gram: bool) -> float:
    """σ² threshold of the numerical rank ÷ σ²_max for R of ``shape`` (d, N): (max(d, N)·eps)², eps of R's working
    ``dtype``; with ``gram`` (eigenvalues of a float64 Gram: they carry ~max(d, N)·eps64·λ_max of round-off) at least
    max(d, N)·eps64."""
    tol = (max(shape) * torch.finfo(dtype).eps) ** 2
    return max(tol, max(shape) * torch.finfo(torch.float64).eps) if gram else tol


@dataclass(frozen=True)
class Spectrum:
    """σ² of R (descending, float64) and the matching left singular vectors, (d, m) in R's dtype — or, with
    ``gram`` (the ``cols`` route of ``spectra``), R itself in float64, its Gram RᵀR and the Gram's eigenvectors V
    (descending): at rank N R's columns span the kept space whole; below it ``_singular_vectors`` makes the vectors
    (R V = U Σ)."""

    sq: Tensor
    vectors: Tensor
    cols: int  # N, the number of columns of R (over all ranks when distributed)
    route: str
    source: torch.dtype = torch.float32  # R's own dtype: the precision of the energy rule
    gram: Tensor | None = None
    gram_vectors: Tensor | None = None


def spectrum_of_gram(gram: Tensor, cols: int, dtype: torch.dtype) -> Spectrum:
    """eigh of R Rᵀ (d, d), float64: σ² = eigenvalues, the eigenvectors are R's left singular vectors."""
    lam, vecs = torch.linalg.eigh(gram)  # ascending; (d,), (d, d)
    return Spectrum(lam.flip(0).clamp_min(0), vecs.flip(1).to(working_dtype(dtype)), cols, "gram", dtype)


def gram(rep: Tensor) -> Tensor:
    r64 = rep.double()
    return r64 @ r64.T  # (d, d)


def svd_spectrum(rep: Tensor) -> Spectrum:
    """Thin SVD of R (d, N), N < d, in float64: a float32 SVD's vectors are orthogonal to ~1e-6 only."""
    u, s, _ = torch.linalg.svd(rep.double(), full_matrices=False)  # u: (d, N), s: (N,)
    return Spectrum(s**2, u.to(working_dtype(rep.dtype)), rep.shape[1], "svd", rep.dtype)


Batch = tuple[list[int], Tensor, str, Tensor]  # indices of its R, their float64 stack (b, d, N), route, Grams


def gram_batches(reps: Sequence[Tensor]) -> list[Batch]:
    """R of one shape, dtype and device stacked in float64 (b, d, N), each batch with the indices of its R, its route
    (``gram`` when N ≥ d, else ``cols``) and the Gram of the smaller side: what ``spectra`` decomposes."""
    groups: dict[tuple, list[int]] = {}
    for i, rep in enumerate(reps):
        groups.setdefault((tuple(rep.shape), rep.dtype, rep.device), []).append(i)
    out = []
    for (shape, _, _), idx in groups.items():
        stack = torch.stack([reps[i] for i in idx]).double()
        route = "gram" if shape[1] >= shape[0] else "cols"
        out.append((idx, stack, route, stack @ stack.mT if route == "gram" else stack.mT @ stack))
    return out


def _batches_of(batches: list[Batch], chosen: list[int]) -> list[Batch]:
    """The R of ``batches`` whose index is in ``chosen``, indexed by their place in ``chosen``: what
    ``gram_batches`` of those R alone gives, without stacking them and making their Grams again."""
    place = {i: p for p, i in enumerate(chosen)}
    out = []
    for idx, stack, route, g in batches:
        rows = [j for j, i in enumerate(idx) if i in place]
        if rows:
            whole = len(rows) == len(idx)
            out.append(([place[idx[j]] for j in rows], stack if whole else stack[rows], route, g if whole else g[rows]))
    return out


def spectra(reps: Sequence[Tensor], batches: list[Batch] | None = None,
            routes: EighRoutes | None = None) -> list[Spectrum]:
    """The spectrum of every R by its shape's route (``gram`` when N ≥ d, else ``cols``), batched.

    R of one shape, dtype and device are stacked and decomposed by one batched eigh; every σ² then comes
    to the host in one copy (the τ rule reads them there), so a list of R costs one host sync per
    distinct shape (eigh checks its result) and one more, not a few per layer. The ``cols`` route keeps R, its Gram
    and the Gram's eigenvectors for what the rank needs next (``_kept_vectors``, ``_singular_vectors``). An R that
    comes here under the default rule is one whose full rank ``whole_spans`` could not prove — of lower rank, as a
    rule, whose basis needs the eigenvectors: they come with the eigenvalues, in one decomposition.
    """
    found: dict[int, tuple[Tensor, Tensor, str, Tensor | None, Tensor | None]] = {}
    for idx, stack, route, g in gram_batches(reps) if batches is None else batches:
        lam, vecs = eigh(g, routes)  # ascending; on the device or the host's cores, whichever was measured faster
        lam, vecs = lam.flip(-1).clamp_min(0), vecs.flip(-1)
        if route == "cols":
            found.update((i, (lam[j], stack[j], route, g[j], vecs[j])) for j, i in enumerate(idx))
        else:
            found.update((i, (lam[j], vecs[j], route, None, None)) for j, i in enumerate(idx))
    if not reps:
        return []
    host = torch.cat([found[i][0] for i in range(len(reps))]).cpu()  # every σ², one copy
    out, offset = [], 0
    for i, rep in enumerate(reps):
        lam, vecs, route, g, v = found[i]
        sq = host[offset : offset + lam.numel()]
        offset += lam.numel()
        kept_as_is = route == "cols"  # R, float64: made orthonormal (or R V), in R's working dtype, once k is known
        out.append(Spectrum(sq, vecs if kept_as_is else vecs.to(working_dtype(rep.dtype)), rep.shape[1], route,
                            rep.dtype, g, v))
    return out


def _singular_vectors(specs: list[Spectrum], ranks: list[tuple[int, float] | None]) -> list[Spectrum]:
    """Spectra of a ``cols`` R (``gram`` set) of rank below N get their R V = U Σ; the others stay as they are (at
    rank N, R itself spans the kept space)."""
    return [replace(spec, vectors=spec.vectors @ spec.gram_vectors, gram=None, gram_vectors=None)
            if spec.gram_vectors is not None and rank is not None and rank[0] < spec.cols else spec
            for spec, rank in zip(specs, ranks, strict=True)]


def orthonormalize(u: Tensor, gram: Tensor | None = None, passes: int = 2, fill: Tensor | None = None) -> Tensor:
    """CholeskyQR2: u (d, k) — or a batch (b, d, k) — of full column rank -> an orthonormal basis of its span, same
    column order; ``gram``: its UᵀU when already made (the first pass takes it); ``passes=1``: the second pass alone,
    for a U already made nearly orthonormal (``whole_spans``); ``fill`` (k,) or (b, k): added to the Gram's diagonal,
    1 where U has a zero column (kept zero, the others made orthonormal).

    Q = U L⁻ᵀ with L Lᵀ = UᵀU, twice: the second pass takes the first's ε·κ² loss of orthogonality to ε (for κ(U)
    below ε^(-1/2); a rank-N R of the ``cols`` route has κ ≤ (max(d, N)·ε₆₄)^(-1/2), 1.5e6 at d = 2048).
    ``cholesky_ex``: no host sync on a GPU (``cholesky`` checks its info flag on the host).
    """
    for _ in range(passes):
        gram = u.mT @ u if gram is None else gram
        chol, _ = torch.linalg.cholesky_ex(gram if fill is None else gram + torch.diag_embed(fill))  # (k, k), lower
        u, gram = torch.linalg.solve_triangular(chol.mT, u, upper=True, left=False), None  # U L⁻ᵀ
    return u


def _kept_vectors(spec: Spectrum, k: int) -> Tensor:
    """The first k left singular vectors, orthonormal, in the working dtype."""
    if spec.route != "cols":
        return spec.vectors[:, :k].contiguous()
    if spec.gram is not None:  # rank N: R's own columns span the kept space
        return orthonormalize(spec.vectors, spec.gram).to(working_dtype(spec.source))
    scale = spec.sq[:k].sqrt().reciprocal().to(spec.vectors.device)  # host -> device: a copy, no sync
    return orthonormalize(spec.vectors[:, :k] * scale).to(working_dtype(spec.source))


def _rank(spec: Spectrum, tau: float, rule: str) -> tuple[int, float] | None:
    """(k, ‖R_k‖²_F / ‖R‖²_F) by eq. 3 and the numerical rank, read on the host's σ²; None for an all-zero R."""
    sq, d = spec.sq, spec.vectors.shape[0]
    total = float(sq.sum())
    if total == 0.0:
        return None
    wdtype = working_dtype(spec.source)
    tol = _relative_tol((d, spec.cols), wdtype, spec.route != "svd") * float(sq[0])
    k = tau_rank(sq, tau, tol) if rule == "numerical_rank" else energy_rank(sq, tau, wdtype)
    return k, float(sq[:k].sum()) / total


def _basis(spec: Spectrum, rank: tuple[int, float] | None, kept: Tensor | None = None) -> Basis:
    """The basis of rank ``rank`` (``_rank``): the smaller of span and complement; ``kept``: its span's vectors
    when already made (``_kept_together``)."""
    vectors = spec.vectors
    d = vectors.shape[0]
    if rank is None:  # an all-zero input: nothing to keep, every direction is free
        eye = torch.eye(d, dtype=working_dtype(spec.source), device=vectors.device)
        return Basis(d, 0, 1.0, None, eye, spec.route)
    k, captured = rank
    free = vectors[:, k:].contiguous() if spec.route == "gram" else None
    # keep only the smaller side; projecting with it costs 2·C_o·d·min(k, d−k)
    if free is not None and free.shape[1] <= k:
        return Basis(d, k, captured, None, free, spec.route)
    return Basis(d, k, captured, _kept_vectors(spec, k) if kept is None else kept, None, spec.route)


def select_basis(spec: Spectrum, tau: float, rule: str = "numerical_rank") -> Basis:
    """Apply eq. 3 (and the numerical rank) to a spectrum; keep the smaller of span and complement."""
    return _basis(spec, _rank(spec, tau, rule))


def _kept_together(specs: list[Spectrum], ranks: list[tuple[int, float] | None],
                   pad: bool | None = None) -> dict[int, Tensor]:
    """The kept vectors of every ``cols`` spectrum that shares (d, N, k, dtype, device) with another, made orthonormal
    in one batched CholeskyQR2 (a transformer's blocks: ~10 kernels a shape, not ~10 a layer). With ``pad`` (None:
    off the CPU) ranks may differ within a group (a trained model's R: 67-256 of 256 across the GPT-style LM's
    blocks, each its own): each R V Σ⁻¹ is padded to the group's largest k with zero columns, which CholeskyQR keeps
    zero (``fill``), and each basis is its own first k columns — fewer kernels (that LM's bases 532 -> 442, CPU
    count), more flops (the CPU's bases 340 -> 380 ms, which is why it does not pad)."""
    groups: dict[tuple, list[int]] = {}
    for i, (spec, rank) in enumerate(zip(specs, ranks, strict=True)):
        if rank is not None and rank[0] > 0 and spec.route == "cols":
            v, whole = spec.vectors, spec.gram is not None
            padded = (v.device.type != "cpu" if pad is None else pad) and not whole
            groups.setdefault((*v.shape, None if padded else rank[0], v.dtype, v.device, spec.source, whole),
                              []).append(i)
    out: dict[int, Tensor] = {}
    for (_, _, _, _, device, source, whole), idx in groups.items():
        if len(idx) < 2:
            continue
        if whole:  # rank N: the R themselves, their Grams for the first pass
            u = orthonormalize(torch.stack([specs[i].vectors for i in idx]),
                               torch.stack([specs[i].gram for i in idx]))  # type: ignore[misc]
            out.update(zip(idx, u.to(working_dtype(source)).unbind(0), strict=True))
            continue
        ks = [ranks[i][0] for i in idx]  # type: ignore[index]
        top = max(ks)
        scale = torch.zeros(len(idx), top, dtype=torch.float64)  # 1/σ of each kept column, 0 past its k (host)
        for row, (i, k) in enumerate(zip(idx, ks, strict=True)):
            scale[row, :k] = specs[i].sq[:k].sqrt().reciprocal()
        fill = None if min(ks) == top else (scale == 0).double().to(device)  # padded columns: kept zero
        u = torch.stack([specs[i].vectors[:, :top] for i in idx]) * scale.to(device)[:, None, :]  # one copy, no sync
        u = orthonormalize(u, fill=fill).to(working_dtype(source))
        out.update((i, u[row, :, :k]) for row, (i, k) in enumerate(zip(idx, ks, strict=True)))
    return out


def compute_basis(rep: Tensor, tau: float = 1.0, rule: str = "numerical_rank", route: str = "auto") -> Basis:
    """The basis of R (d, N) by eq. 3: ``route`` "auto" (a proven full rank, else eigh of the smaller Gram: see
    ``compute_bases``) or "svd"."""
    if route == "svd" and rep.shape[1] < rep.shape[0]:
        return select_basis(svd_spectrum(rep), tau, rule)
    return compute_bases([rep], tau, rule)[0]


def compute_bases(reps: Sequence[Tensor], tau: float, rule: str = "numerical_rank",
                  proofs: Proofs | None = None, routes: EighRoutes | None = None) -> list[Basis]:
    """``compute_basis`` of every R, batched. At τ = 1 by the numerical rank (the default) an R whose full rank is
    proven keeps its whole span without a spectrum (``whole_spans``) — every R put to the certificate, or those
    ``proofs`` (the model's) finds worth it; the others (and every R under another rule) by ``spectra``: one eigh
    per shape, one host sync for the τ rule, R V for an R of rank below N (``_singular_vectors``), the kept vectors
    of one shape made orthonormal together (``_kept_together``)."""
    batches = gram_batches(reps)
    found: dict[int, Basis] = {}
    if rule == "numerical_rank" and tau >= 1.0:
        tried = list(range(len(reps))) if proofs is None else proofs.worth(reps)
        spans = whole_spans([reps[i] for i in tried], _batches_of(batches, tried))  # all of them: the batches as made
        found = {tried[j]: b for j, b in spans.items()}
        if proofs is not None:
            proofs.record(reps, tried, set(found))
    rest = [i for i in range(len(reps)) if i not in found]
    if rest:
        found.update(zip(rest, _decomposed([reps[i] for i in rest], tau, rule, _batches_of(batches, rest), routes),
                         strict=True))
    return [found[i] for i in range(len(reps))]


def whole_spans(reps: Sequence[Tensor], batches: list[Batch] | None = None) -> dict[int, Basis]:
    """The basis of every R whose full numerical rank ``certificate`` proves, by its index: at N < d its own
    columns made orthonormal (CholeskyQR, its first pass a product with the certificate's L⁻¹; a column repeating an
    earlier one left out, a zero column in its place: ``without_duplicates``), at N ≥ d no free direction. One host
    read for all (the certificates); no eigenvalue is computed. ``batches``: ``gram_batches(reps)`` when already made.

    The first pass leaves UᵀU − I at ~ε₆₄·κ(G) (measured 0.2-0.4 of it on the GPT-style LM's R, 1e-13): where the
    certificate's bound on κ(G) puts that ``ONE_PASS`` below the working dtype's ε (a float32 basis of κ(G) ≤ 5e6),
    the second pass would change nothing the rounding to float32 keeps, and is left out."""
    checks, flags = [], []
    for idx, stack, route, g in gram_batches(reps) if batches is None else batches:
        duplicate = torch.zeros(stack.shape[0], stack.shape[-1], dtype=torch.bool, device=stack.device)
        if route == "cols":
            g, duplicate = without_duplicates(stack, g)
        ok, condition, inverse = certify_full_rank(g, _relative_tol(tuple(stack.shape[-2:]),
                                                                    working_dtype(reps[idx[0]].dtype), True))
        checks.append((idx, stack, route, inverse, duplicate))
        flags.append(torch.stack([ok.double(), condition, duplicate.sum(-1).double()], 1))
    read = torch.cat(flags).tolist() if flags else []  # the one host read
    out: dict[int, Basis] = {}
    for idx, stack, route, inverse, duplicate in checks:
        mine, read = read[: len(idx)], read[len(idx) :]
        chosen = [j for j, (ok, _, _) in enumerate(mine) if ok]
        if chosen:
            bases = _spans(stack, route, inverse, duplicate, chosen, working_dtype(reps[idx[0]].dtype),
                           max(mine[j][1] for j in chosen), [int(mine[j][2]) for j in chosen])
            out.update(zip([idx[j] for j in chosen], bases, strict=True))
    return out


def _spans(stack: Tensor, route: str, inverse: Tensor, duplicate: Tensor, chosen: list[int], dtype: torch.dtype,
           condition: float, repeats: list[int]) -> list[Basis]:
    """The bases of the ``chosen`` R of one ``gram_batches`` batch, proven full rank (see ``whole_spans``)."""
    d, n = stack.shape[-2:]
    if route == "gram":
        free = torch.zeros(d, 0, dtype=dtype, device=stack.device)
        return [Basis(d, d, 1.0, None, free, route) for _ in chosen]
    if len(chosen) < stack.shape[0]:
        stack, inverse, duplicate = stack[chosen], inverse[chosen], duplicate[chosen]
    enough = condition * torch.finfo(torch.float64).eps <= ONE_PASS * torch.finfo(dtype).eps
    first = inverse.mT  # L⁻ᵀ; R' L⁻ᵀ = R (diag(kept columns) L⁻ᵀ): R's repeated columns left out by L⁻ᵀ's rows
    fill = None
    if any(repeats):
        fill = duplicate.to(stack.dtype)  # a zero column's Gram entry in the second pass, as in the certificate
        first = first * (1 - fill)[..., :, None]
    kept = orthonormalize(stack @ first, passes=0 if enough else 1, fill=fill).to(dtype)  # R L⁻ᵀ, a second pass
    return [Basis(d, n - r, 1.0, u, None, route) for u, r in zip(kept.unbind(0), repeats, strict=True)]


def _decomposed(reps: Sequence[Tensor], tau: float, rule: str, batches: list[Batch] | None = None,
                routes: EighRoutes | None = None) -> list[Basis]:
    """``compute_bases`` by the spectra (see there); ``batches``: ``gram_batches(reps)`` when already made."""
    specs = spectra(reps, batches, routes)
    ranks = [_rank(spec, tau, rule) for spec in specs]
    specs = _singular_vectors(specs, ranks)
    kept = _kept_together(specs, ranks)
    return [_basis(spec, rank, kept.get(i)) for i, (spec, rank) in enumerate(zip(specs, ranks, strict=True))]
