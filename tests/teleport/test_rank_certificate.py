"""A full rank proven without eigenvalues (``teleport.geometry.certificate``, ``bases.whole_spans``): never where the
eigenvalues say otherwise, always where they say so by a wide margin, and the same bases as the SVD's."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from teleport import compute_basis, project
from teleport.geometry import bases
from teleport.geometry.bases import _decomposed, _relative_tol, compute_bases, whole_spans
from teleport.geometry.certificate import MARGIN


def _with_spectrum(d: int, n: int, sigma: Tensor, dtype: torch.dtype, seed: int) -> Tensor:
    """R (d, n) with singular values ``sigma`` (descending) and random singular vectors, drawn by the CPU's generator
    and put on the tests' device."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(d, n, dtype=torch.float64, generator=g, device="cpu"))
    v, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g, device="cpu"))
    return ((u * sigma.double().cpu()) @ v.T).to(dtype=dtype, device=torch.get_default_device())


def _count_eigen(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in ("eigh", "eigvalsh"):
        real = getattr(torch.linalg, name)
        monkeypatch.setattr(torch.linalg, name, lambda a, *args, _real=real, _name=name, **kw:
                            calls.append(_name) or _real(a, *args, **kw))
    return calls


def test_full_rank_representations_need_no_eigenvalues(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both routes at full rank (N < d: R's own columns; N ≥ d: no free direction) without an eigh or eigvalsh, and
    each basis projects as the SVD's; an R of lower rank beside them is left to the eigenvalues."""
    torch.manual_seed(7)
    calls = _count_eigen(monkeypatch)
    cols = [torch.randn(40, 12, dtype=torch.float64) for _ in range(3)]
    wide = torch.randn(9, 30, dtype=torch.float64)  # N ≥ d, rank d
    low = torch.randn(40, 5, dtype=torch.float64) @ torch.randn(5, 12, dtype=torch.float64)
    proven = compute_bases([*cols, wide], 1.0)
    assert calls == []
    assert proven[3].rank == 9 and proven[3].free is not None and proven[3].free.shape == (9, 0)
    assert torch.equal(project(torch.randn(4, 9, dtype=torch.float64), proven[3]), torch.zeros(4, 9,
                                                                                              dtype=torch.float64))
    mixed = compute_bases([*cols, low], 1.0)
    assert calls == ["eigh"]  # the rank-5 R alone: its eigenvalues and vectors at once
    for rep, b in zip([*cols, low], [*proven[:3], mixed[3]], strict=True):
        svd = compute_basis(rep, 1.0, route="svd")
        assert b.rank == svd.rank and b.kept is not None
        g = torch.randn(4, 40, dtype=torch.float64)
        assert torch.allclose(project(g, b), project(g, svd), atol=1e-12)
        assert torch.allclose(b.kept.T @ b.kept, torch.eye(b.rank, dtype=torch.float64), atol=1e-13)  # two passes
    assert [b.rank for b in proven[:3]] == [12] * 3 and mixed[3].rank == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_certificate_agrees_with_the_eigenvalues_around_the_threshold(dtype: torch.dtype) -> None:
    """σ_min swept across the numerical rank's threshold: a proven full rank is never one the eigenvalues call
    lower, and an R clear of the threshold by the bounds' slack (n^1.5·MARGIN) is always proven."""
    d, n = 48, 16
    rel = _relative_tol((d, n), dtype, True)  # on σ²
    proven = []
    for seed, ratio in enumerate([0.3, 0.9, 1.1, 3, 10, 100, 1e3, 1e4, 1e5]):  # σ²_min / threshold
        sigma = torch.logspace(0, 0.5 * torch.log10(torch.tensor(ratio * rel)).item(), n)  # σ_max = 1
        rep = _with_spectrum(d, n, sigma, dtype, seed)
        spectral = _decomposed([rep], 1.0, "numerical_rank")[0]
        found = whole_spans([rep])
        if found:
            assert spectral.rank == n, f"proven full rank at σ²_min = {ratio}x the threshold, eigenvalues say less"
            assert found[0].rank == n
        if ratio > n**1.5 * MARGIN * 2:
            assert found, f"σ²_min = {ratio}x the threshold was not proven"
        proven.append(bool(found))
    assert not proven[0] and proven[-1]


def test_a_float32_basis_from_one_pass_is_as_orthonormal_as_float32_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 R of moderate κ takes the first CholeskyQR pass (R L⁻ᵀ) alone, a steep one (κ(G) = 1e8) the second
    too; each orthonormal to float32's rounding and the SVD's projector to float32's precision."""
    passes: list[int] = []
    real = bases.orthonormalize
    monkeypatch.setattr(bases, "orthonormalize", lambda u, gram=None, passes=2, _log=passes, **kw:
                        _log.append(passes) or real(u, gram, passes, **kw))
    for kappa, seed in ((1e2, 0), (1e4, 1)):  # κ(R)
        rep = _with_spectrum(64, 20, torch.logspace(0, -torch.log10(torch.tensor(kappa)).item(), 20),
                             torch.float32, seed)
        b = whole_spans([rep])[0]
        assert b.kept is not None and b.kept.dtype == torch.float32
        assert (b.kept.T @ b.kept - torch.eye(20)).abs().max() < 1e-6
        g = torch.randn(5, 64)
        svd = compute_basis(rep, 1.0, route="svd")
        assert (project(g, b) - project(g, svd)).abs().max() < 1e-5 * g.abs().max()
    assert passes == [0, 1]  # after the product with L⁻ᵀ: none more, then one


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_repeated_columns_are_left_out_without_eigenvalues(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """An R with columns repeated bit for bit (an LM's shared token at a position) is proven of rank N minus the
    repeats: the SVD's rank and projector, a zero column in each repeat's place, orthonormal elsewhere; a column
    that differs from another by 1e-3 of it is no repeat."""
    torch.manual_seed(8)
    calls = _count_eigen(monkeypatch)
    base = torch.randn(40, 12, dtype=dtype)
    rep = torch.cat([base, base[:, [3, 7]], base[:, [3]]], 1)  # columns 12, 14 repeat 3, column 13 repeats 7
    near = torch.cat([base, base[:, [5]] + 1e-3 * torch.randn(40, 1, dtype=dtype)], 1)
    repeated, nearly = compute_bases([rep, near], 1.0)
    assert calls == []
    assert repeated.rank == 12 and nearly.rank == 13
    kept = repeated.kept
    assert kept is not None and kept.shape == (40, 15)
    assert torch.equal(kept[:, 12:], torch.zeros(40, 3, dtype=dtype))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert (kept[:, :12].T @ kept[:, :12] - torch.eye(12, dtype=dtype)).abs().max() < tol
    svd = compute_basis(rep.double(), 1.0, route="svd")
    g = torch.randn(4, 40, dtype=torch.float64)
    assert svd.rank == 12
    assert (project(g, bases.Basis(40, 12, 1.0, kept.double(), None, "cols")) - project(g, svd)).abs().max() < tol * 10


@pytest.mark.usefixtures("float64")
def test_an_lm_batch_whose_sequences_share_their_first_token_needs_no_eigenvalues(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same first token in both sequences (a BOS token) repeats a column of every block's inputs (causal
    attention: position 0 sees itself alone): every R is proven all the same, and the teleport keeps the loss."""
    from teleport import TeleportConfig, teleport_batch
    from tests.teleport.families import CASES

    case = CASES["tied_lm"]()
    tokens = torch.tensor([[1, 2, 3, 4, 5], [1, 6, 7, 8, 9]])
    calls = _count_eigen(monkeypatch)
    report = teleport_batch(case.model, case.loss_fn, tokens, tokens, TeleportConfig(steps=3, lr=0.03, cap=1e9,
                                                                                       loss_tol=1e9))
    assert calls == [] and report.steps == 3
    assert any(layer.rank < 10 for layer in report.layers)  # 10 token columns, some of them repeats
    assert abs(report.loss_after - report.loss_before) <= 1e-9 * abs(report.loss_before)


def _count_certificates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of Grams each call of the certificate is given."""
    calls: list[int] = []
    real = bases.certify_full_rank
    monkeypatch.setattr(bases, "certify_full_rank",
                        lambda g, tol, _real=real: calls.append(g.shape[0]) or _real(g, tol))
    return calls


def test_an_r_the_certificate_failed_goes_to_the_eigenvalues_until_its_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a model's ``Proofs``, an R the certificate did not prove skips it for ``RETRY`` batches and is tried
    again after them, an R it proved is tried every batch; the bases are the same as without the memory."""
    from teleport.geometry.certificate import RETRY, Proofs

    torch.manual_seed(3)
    full = torch.randn(40, 12, dtype=torch.float64)
    low = torch.randn(40, 5, dtype=torch.float64) @ torch.randn(5, 12, dtype=torch.float64)  # rank 5 of 12
    wide = torch.randn(30, 6, dtype=torch.float64) @ torch.randn(6, 50, dtype=torch.float64)  # N ≥ d, rank 6 of 30
    reps = [full, low, wide]
    alone = compute_bases(reps, 1.0)
    calls, eigen = _count_certificates(monkeypatch), _count_eigen(monkeypatch)
    proofs = Proofs()
    tried = []
    for _ in range(RETRY + 2):
        before = len(calls)
        remembered = compute_bases(reps, 1.0, proofs=proofs)
        tried.append(sum(calls[before:]))
        for a, b in zip(alone, remembered, strict=True):
            assert a.rank == b.rank and a.route == b.route
            g = torch.randn(3, a.dim, dtype=torch.float64)
            assert torch.allclose(project(g, a), project(g, b), atol=1e-12)
    assert tried == [3] + [1] * RETRY + [3]  # the full-rank R every batch, the others again after RETRY
    assert len(eigen) == 2 * (RETRY + 2)  # low's and wide's (two shapes) every batch


def test_a_teleported_model_remembers_what_its_certificate_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``Teleporter`` keeps its model's ``Proofs`` (and saves them): an MLP whose inputs are of low rank (every R
    unproven) puts its R to the certificate on its first batch only; another model starts afresh."""
    from teleport import TeleportConfig, Teleporter

    torch.manual_seed(4)
    calls = _count_certificates(monkeypatch)
    x = torch.randn(32, 4) @ torch.randn(4, 16)  # rank 4 of 16: the first layer's R is unproven
    y = torch.randn(32, 3)
    config = TeleportConfig(steps=2, lr=0.01, cap=1e9, loss_tol=1e9)

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))

    first, second = (Teleporter(mlp(), torch.nn.functional.mse_loss, config) for _ in range(2))
    certified = []
    for teleporter in (first, first, first, second):
        before = len(calls)
        report = teleporter.teleport(x, y)
        assert report.steps == 2
        certified.append(sum(calls[before:]))
    # the first layer's R ([x | 1], rank 5 of 17) fails; the second's (N 32 < d 65) is proven, and tried every batch
    assert certified == [2, 1, 1, 2]
    resumed = Teleporter(mlp(), torch.nn.functional.mse_loss, config)
    resumed.load_state_dict(first.state_dict())
    before = len(calls)
    resumed.teleport(x, y)
    assert sum(calls[before:]) == 1  # the memory came with the state
