"""Invariants of the teleport core, in float64 on CPU: ΔL ≈ 0, ‖∇L‖² rises, U·R = 0, π² = π, CAP holds."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from teleport import (
    SerialExecutor,
    TeleportConfig,
    ThreadExecutor,
    capture_inputs,
    compute_basis,
    project,
    symmetry_teleport_batch,
    teleport_batch,
)
from teleport.geometry.bases import _kept_together, _rank, _singular_vectors, compute_bases, spectra
from teleport.geometry.layer_bases import layer_bases
from teleport.geometry.projection import project_split
from teleport.hvp.objective import objective, teleport_gradient
from workers.train import models

pytestmark = pytest.mark.usefixtures("float64")


def MLP(dims: list[int]) -> nn.Module:  # noqa: N802 - reads like the class it builds
    """The project's MLP with LeakyReLU (what symmetry teleport needs): dims = [in, *hidden, out]."""
    return models.MLP(dims[0], dims[1:-1], dims[-1], activation="leaky_relu", negative_slope=0.1)


class TinyTransformer(nn.Module):
    """Embedding in, one pre-LN block with Linear Q/K/V/O, mean pooling, a head."""

    def __init__(self, vocab: int = 11, d: int = 16, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)  # (B, T, d)
        b, t, d = h.shape
        a = self.ln1(h)
        q, k, v = (p(a).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v)  # (B, nh, T, hs)
        h = h + self.o(att.transpose(1, 2).reshape(b, t, d))
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return self.head(h.mean(1))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 5),
    )


def make_case(kind: str, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP([20, 48, 48, 5]), torch.randn(24, 20), torch.randint(0, 5, (24,))
    if kind == "cnn":
        return cnn(), torch.randn(12, 3, 8, 8), torch.randint(0, 5, (12,))
    return TinyTransformer(), torch.randint(0, 11, (6, 5)), torch.randint(0, 3, (6,))


CONFIG = TeleportConfig(steps=6, lr=0.5, cap=1e6, tau=1.0, loss_tol=1e-6)


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_exact_nullspace_keeps_loss_and_raises_grad_norm(kind: str) -> None:
    model, x, y = make_case(kind)
    report = teleport_batch(model, F.cross_entropy, x, y, CONFIG)
    assert abs(report.loss_after - report.loss_before) <= 1e-6 * abs(report.loss_before)
    assert report.free_directions > 0
    assert report.steps > 0 and report.stop_reason in {"steps", "cap"}
    assert report.grad_norm_sq_after > report.grad_norm_sq_before * 1.01
    with torch.no_grad():  # the report's numbers are the model's
        assert F.cross_entropy(model(x), y).item() == pytest.approx(report.loss_after, rel=1e-12)


def test_conv_layers_without_free_directions_are_reported_and_tau_below_one_opens_them() -> None:
    model, x, y = make_case("cnn")
    exact = teleport_batch(copy.deepcopy(model), F.cross_entropy, x, y, CONFIG)
    convs = [layer for layer in exact.layers if layer.kind == "conv2d"]
    assert convs and all(layer.free == 0 and layer.rank == layer.input_dim for layer in convs)
    loose = teleport_batch(model, F.cross_entropy, x, y,
                           TeleportConfig(steps=6, lr=0.5, cap=1e6, tau=0.95, loss_tol=0.05))
    assert all(layer.free > 0 for layer in loose.layers if layer.kind == "conv2d")
    assert loose.free_directions > exact.free_directions
    assert loose.grad_norm_sq_after > loose.grad_norm_sq_before
    assert loose.loss_after - loose.loss_before <= 0.05 * loose.loss_before  # the stated tolerance


def test_first_layer_cannot_move_at_tau_one() -> None:
    model, x, y = make_case("mlp")  # the batch (24) spans all 21 input directions of layer 0
    first = model.layers[0].weight.detach().clone()
    report = teleport_batch(model, F.cross_entropy, x, y, CONFIG)
    assert report.layers[0].free == 0
    assert torch.equal(model.layers[0].weight, first)


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_projected_update_annihilates_each_layers_representation(kind: str) -> None:
    model, x, y = make_case(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    with capture_inputs(model) as captured:
        obj = objective(model, F.cross_entropy, x, y, params)
    blocks = layer_bases(captured, 0.9 if kind == "cnn" else 1.0, SerialExecutor())
    all_grads = teleport_gradient(obj, [p for block in blocks for p in block.params], params)
    for block in blocks:
        grads, all_grads = all_grads[: len(block.params)], all_grads[len(block.params) :]
        update = block.projected(grads)
        u = block.matrix(update[0])  # (rows, C)
        if len(update) == 2:
            u = torch.cat([u, update[1].reshape(-1, 1)], dim=1)
        for cls in block.classes:
            rep, basis = block.representation(cls), cls.basis
            assert basis is not None
            if basis.free_dims == basis.dim:  # nothing kept: nothing to check
                continue
            uc = u if cls.rows is None else u[cls.rows]
            # U·R = 0 in the kept span: exactly at τ=1; at τ<1 only the dropped σ's leak through
            residual = (uc @ rep).norm() / (uc.norm() * rep.norm() + 1e-300)
            assert residual < (1e-10 if kind != "cnn" else 0.35)
            if basis.kept is not None:
                assert (uc @ basis.kept).abs().max() < 1e-10


def test_projection_is_idempotent_and_orthogonal_for_both_forms() -> None:
    torch.manual_seed(1)
    for d, n in [(40, 10), (12, 200)]:  # thin-SVD route, Gram route
        rep = torch.randn(d, 3) @ torch.randn(3, n)  # rank 3
        basis = compute_basis(rep, 1.0)
        assert basis.rank == 3
        g = torch.randn(7, d)
        once = project(g, basis)
        assert torch.allclose(project(once, basis), once, atol=1e-12)
        assert (once @ rep).abs().max() < 1e-9
        assert torch.allclose((g - once) @ once.T, torch.zeros(7, 7), atol=1e-9)  # orthogonal split


def test_both_routes_find_the_same_subspace_and_tau_rule() -> None:
    torch.manual_seed(2)
    rep = torch.randn(30, 30) @ torch.diag(torch.logspace(0, -3, 30)) @ torch.randn(30, 60)
    for tau in [1.0, 0.999, 0.9]:
        gram = compute_basis(rep, tau)  # N ≥ d
        cols = compute_basis(rep[:, :29].contiguous(), tau)  # N < d: eigh of RᵀR
        svd = compute_basis(rep[:, :29].contiguous(), tau, route="svd")  # N < d: thin SVD
        assert (gram.route, cols.route, svd.route) == ("gram", "cols", "svd")
        assert cols.rank == svd.rank
        assert torch.allclose(cols.kept.T @ cols.kept, torch.eye(cols.rank), atol=1e-13)  # CholeskyQR2
        g = torch.randn(3, 30)
        assert torch.allclose(project(g, cols), project(g, svd), atol=1e-9)
        s2 = torch.linalg.svdvals(rep) ** 2
        k = int((torch.cumsum(s2, 0) < tau * s2.sum() * (1 - 1e-12)).sum()) + 1
        assert gram.rank == min(k, 30)
        assert gram.captured_variance >= tau - 1e-12
    # the same rank-r subspace whichever route finds it
    low = torch.randn(25, 4) @ torch.randn(4, 50)
    a, b = compute_basis(low, 1.0), compute_basis(low[:, :20].contiguous(), 1.0)
    c = compute_basis(low[:, :20].contiguous(), 1.0, route="svd")
    g = torch.randn(3, 25)
    assert torch.allclose(project(g, a), project(g, b), atol=1e-9)
    assert torch.allclose(project(g, c), project(g, b), atol=1e-9)


def test_bases_of_equal_shapes_are_batched_and_match_one_by_one() -> None:
    torch.manual_seed(5)
    reps = [torch.randn(40, 12) @ torch.diag(torch.logspace(0, -4, 12)) @ torch.randn(12, 12) for _ in range(3)]
    reps += [torch.randn(9, 30), torch.randn(40, 12)[:, :7].contiguous()]  # a Gram-route shape, a third shape
    for tau in [1.0, 0.99]:
        batched = compute_bases(reps, tau)
        for rep, b in zip(reps, batched, strict=True):
            alone = compute_basis(rep, tau, route="svd")
            assert (b.rank, b.dim) == (alone.rank, alone.dim)
            g = torch.randn(4, rep.shape[0])
            assert torch.allclose(project(g, b), project(g, alone), atol=1e-8)
            if b.kept is not None:  # orthonormal whether made alone or with its shape's others
                assert torch.allclose(b.kept.T @ b.kept, torch.eye(b.rank), atol=1e-6)
    specs = spectra(reps[:3])
    together = _kept_together(specs, [_rank(s, 1.0, "numerical_rank") for s in specs])
    assert sorted(together) == [0, 1, 2]  # the three (40, 12) of rank 12: one batched CholeskyQR2
    # float64, σ down to 3e-7 of σ₁: R V Σ⁻¹ alone is orthogonal to ε·σ₁²/σ_k² ~ 1e-3; the batched QR2 mends it
    steep = [torch.randn(40, 12, dtype=torch.float64) @ torch.diag(torch.logspace(0, -6.5, 12, dtype=torch.float64))
             @ torch.linalg.qr(torch.randn(12, 12, dtype=torch.float64))[0] for _ in range(3)]
    for b in compute_bases(steep, 1.0):
        assert b.rank == 12 and b.kept is not None
        assert torch.allclose(b.kept.T @ b.kept, torch.eye(12, dtype=torch.float64), atol=1e-12)


def test_bases_of_one_shape_and_different_ranks_are_made_orthonormal_together() -> None:
    """A trained model's R of one shape have ranks of their own: their kept vectors go through one batched CholeskyQR2,
    padded to the largest rank with zero columns, and each basis is what it is alone."""
    torch.manual_seed(6)
    reps = [torch.randn(40, r, dtype=torch.float64) @ torch.randn(r, 16, dtype=torch.float64) for r in (3, 9, 14)]
    specs = spectra(reps)
    ranks = [_rank(s, 1.0, "numerical_rank") for s in specs]
    assert _kept_together(_singular_vectors(specs, ranks), ranks) == {}  # the CPU's default: a rank a group
    together = _kept_together(_singular_vectors(specs, ranks), ranks, pad=True)  # a GPU's default
    assert sorted(together) == [0, 1, 2] and [r[0] for r in ranks] == [3, 9, 14]  # one group, three ranks
    for rep, i in zip(reps, range(3), strict=True):
        alone, kept = compute_basis(rep, 1.0, route="svd"), together[i]
        assert kept.shape == (40, alone.rank)
        assert torch.allclose(kept.T @ kept, torch.eye(alone.rank, dtype=torch.float64), atol=1e-12)
        g = torch.randn(4, 40, dtype=torch.float64)
        assert torch.allclose(project(g, replace(alone, kept=kept)), project(g, alone), atol=1e-10)


def test_tau_below_one_keeps_fewer_directions_with_bounded_drift() -> None:
    model, x, y = make_case("transformer")
    ranks, rises, drifts = [], [], []
    for tau in [1.0, 0.999, 0.99]:
        m = copy.deepcopy(model)
        r = teleport_batch(m, F.cross_entropy, x, y, TeleportConfig(steps=4, lr=0.5, cap=1e6, tau=tau,
                                                                      loss_tol=0.01))
        ranks.append(sum(layer.rank for layer in r.layers))
        rises.append((r.loss_after - r.loss_before) / r.loss_before)
        drifts.append(abs(rises[-1]))
    assert ranks[0] > ranks[1] >= ranks[2]
    assert drifts[0] < 1e-12
    assert max(rises) <= 0.01  # the stated tolerance on a rise
    assert max(drifts) <= 0.1  # and the loss may fall, but not by much: we stayed near the level set


def test_float32_rank_tolerance_finds_the_exact_span() -> None:
    torch.manual_seed(3)
    rep = (torch.randn(64, 5) @ torch.randn(5, 300)).float()  # rank 5, float32 round-off
    assert compute_basis(rep, 1.0).rank == 5
    assert compute_basis(rep[:, :40].contiguous(), 1.0).rank == 5


def test_cap_stops_ascent() -> None:
    model, x, y = make_case("mlp")
    start = teleport_batch(copy.deepcopy(model), F.cross_entropy, x, y, TeleportConfig(steps=1, cap=1e6))
    cap = start.grad_norm_sq_before * 1.5
    report = teleport_batch(model, F.cross_entropy, x, y, TeleportConfig(steps=50, lr=2.0, cap=cap))
    assert report.stop_reason == "cap"
    assert report.steps < 50
    assert report.grad_norm_sq_after <= cap  # never overshoots
    already = teleport_batch(model, F.cross_entropy, x, y, TeleportConfig(steps=5, cap=report.grad_norm_sq_after))
    assert already.steps == 0 and already.stop_reason == "cap"


def test_loss_tolerance_backs_off_steps() -> None:
    model, x, y = make_case("cnn")
    report = teleport_batch(model, F.cross_entropy, x, y,
                            TeleportConfig(steps=5, lr=50.0, cap=1e9, tau=0.5, loss_tol=1e-4, max_backoff=3))
    assert report.backoffs > 0
    assert report.loss_after - report.loss_before <= 1e-4 * report.loss_before


def test_representation_reproduces_each_layers_output() -> None:
    """[W | b] R equals the layer's output: the capture honours stride, padding modes, dilation and groups."""
    torch.manual_seed(4)
    layers = [
        nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2, padding_mode="reflect"),
        nn.Conv2d(4, 6, (3, 5), padding="same", bias=False),
        nn.Conv1d(4, 6, 5, stride=2, padding=1, groups=2),
        nn.Conv3d(4, 6, (2, 3, 2), stride=(1, 2, 1), padding=1, dilation=(2, 1, 1), groups=2),
        nn.Linear(4, 3),
    ]
    shapes = {nn.Conv2d: (2, 4, 9, 9), nn.Conv1d: (2, 4, 11), nn.Conv3d: (2, 4, 5, 6, 5), nn.Linear: (2, 5, 4)}
    for layer in layers:
        x = torch.randn(*shapes[type(layer)])
        with capture_inputs(layer) as captured:
            out = layer(x)
        [block] = layer_bases(captured, 1.0, SerialExecutor())
        w = block.augmented()
        for cls in block.classes:
            rows = torch.arange(w.shape[0]) if cls.rows is None else cls.rows
            pred = w[rows] @ block.representation(cls)  # (rows, n·positions)
            ref = out.reshape(-1, 3).T if isinstance(layer, nn.Linear) else out[:, rows].transpose(0, 1)
            assert torch.allclose(pred, ref.reshape(len(rows), -1), atol=1e-10)


def test_shared_inputs_share_one_basis_and_norms_are_untouched() -> None:
    model, x, y = make_case("transformer")
    ln_before = model.ln1.weight.detach().clone()
    emb_before = model.embed.weight.detach().clone()
    report = teleport_batch(model, F.cross_entropy, x, y, CONFIG)
    assert {"embed.weight", "ln1.weight", "ln1.bias", "ln2.weight"} <= set(report.untouched)
    assert torch.equal(model.ln1.weight, ln_before) and torch.equal(model.embed.weight, emb_before)
    by_name = {layer.name: layer for layer in report.layers}
    assert by_name["q"] == type(by_name["q"])("q", "linear", 17, by_name["k"].rank, by_name["k"].free,
                                              by_name["k"].captured_variance)


def test_eval_mode_batchnorm_stats_untouched_and_mode_restored() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3))
    x, y = torch.randn(16, 10), torch.randint(0, 3, (16,))
    model.train()
    model(torch.randn(64, 10))  # some running statistics
    stats = (model[1].running_mean.clone(), model[1].running_var.clone(), int(model[1].num_batches_tracked))
    report = teleport_batch(model, F.cross_entropy, x, y, CONFIG)
    assert model.training
    assert torch.equal(model[1].running_mean, stats[0]) and torch.equal(model[1].running_var, stats[1])
    assert int(model[1].num_batches_tracked) == stats[2]
    assert abs(report.loss_after - report.loss_before) <= 1e-6 * report.loss_before  # dropout was off
    assert "1.weight" in report.untouched


def test_thread_executor_matches_serial() -> None:
    model, x, y = make_case("mlp")
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ra = teleport_batch(a, F.cross_entropy, x, y, CONFIG, executor=SerialExecutor())
    rb = teleport_batch(b, F.cross_entropy, x, y, CONFIG, executor=ThreadExecutor(2))
    assert ra.layers == rb.layers
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-12)


def test_heldout_loss_is_reported_and_may_drift() -> None:
    model, x, y = make_case("mlp")
    hx, hy = torch.randn(50, 20), torch.randint(0, 5, (50,))
    report = teleport_batch(model, F.cross_entropy, x, y, CONFIG, holdout=(hx, hy))
    assert report.heldout_loss_before is not None and report.heldout_loss_after is not None
    assert report.heldout_loss_after != report.heldout_loss_before


def test_symmetry_teleport_keeps_loss_when_batch_fits_the_widths() -> None:
    """Loss-invariant when every transformed layer's augmented input (n, d+1) has full row rank n."""
    torch.manual_seed(6)
    model = MLP([20, 32, 32, 5])
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))  # n = 16 ≤ 21, 33
    cfg = TeleportConfig(steps=4, lr=0.5, cap=1e6, loss_tol=1.0)
    report = symmetry_teleport_batch(model, F.cross_entropy, x, y, cfg)
    assert report.steps > 0
    assert abs(report.loss_after - report.loss_before) <= 1e-6 * report.loss_before
    assert report.grad_norm_sq_after > report.grad_norm_sq_before
    # a batch wider than a layer's input: the least-squares solve is no longer exact and L moves
    big_x, big_y = torch.randn(64, 20), torch.randint(0, 5, (64,))
    moved = symmetry_teleport_batch(MLP([20, 32, 32, 5]), F.cross_entropy, big_x, big_y, cfg)
    assert abs(moved.loss_after - moved.loss_before) > 1e-6 * moved.loss_before


def test_symmetry_teleport_at_the_identity_is_the_model_itself() -> None:
    """g = I leaves every weight as it is, even where the batch is narrower than the layers (n = 16 < 21, 33): a
    solve for the weights themselves (W' = (X⁺ target)ᵀ) kept only their part in the batch's span, and backpropagation
    through the rest made ‖∇L‖² 9 % lower at the same loss."""
    from teleport.symmetry import _augmented, _mlp_layers, transformed_weights

    torch.manual_seed(6)
    model, x = MLP([20, 32, 32, 5]), torch.randn(16, 20)
    layers, slope = _mlp_layers(model)
    weights = [_augmented(m).detach() for m in layers]
    same = transformed_weights(weights, [torch.eye(m.out_features) for m in layers[:-1]], x, slope)
    for w, v in zip(weights, same, strict=True):
        assert torch.allclose(w, v, rtol=0, atol=1e-12)


def test_symmetry_teleport_refuses_non_mlps() -> None:
    with pytest.raises(ValueError, match="leaky_relu"):
        symmetry_teleport_batch(cnn(), F.cross_entropy, torch.randn(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="teleport.tau"):
        TeleportConfig(tau=1.5)
    with pytest.raises(ValueError, match="teleport.lr"):
        TeleportConfig(lr=0)


def test_split_projection_equals_projecting_the_concatenation() -> None:
    torch.manual_seed(7)
    for d, n, rank in [(30, 10, 10), (12, 200, 3), (12, 200, 11)]:  # thin SVD; Gram with kept / free side
        rep = torch.cat([torch.randn(d, rank) @ torch.randn(rank, n), torch.ones(1, n)])  # bias row of ones
        basis = compute_basis(rep, 1.0)
        gw, gb = torch.randn(5, d), torch.randn(5)
        uw, ub = project_split(gw, gb, basis)
        whole = project(torch.cat([gw, gb[:, None]], dim=1), basis)
        assert ub is not None
        assert torch.allclose(uw, whole[:, :d], atol=1e-12) and torch.allclose(ub, whole[:, d], atol=1e-12)


def test_a_teleport_leaves_every_module_in_the_mode_it_found() -> None:
    """A training model whose batch norm is kept frozen (eval mode, as fine-tuning does), and an eval model with a
    dropout left on: a teleport computes in eval mode and puts each module back as it was, not the whole model."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 3))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    model.train()
    model[1].eval()
    before = [m.training for m in model.modules()]
    teleport_batch(model, F.cross_entropy, x, y, CONFIG)
    assert [m.training for m in model.modules()] == before
    model.eval()
    model[3].train()
    before = [m.training for m in model.modules()]
    mlp = MLP([6, 8, 3])
    mlp.train()
    list(mlp.modules())[-1].eval()
    mlp_before = [m.training for m in mlp.modules()]
    teleport_batch(model, F.cross_entropy, x, y, CONFIG)
    symmetry_teleport_batch(mlp, F.cross_entropy, x, y, CONFIG)
    assert [m.training for m in model.modules()] == before and [m.training for m in mlp.modules()] == mlp_before
