"""Teleport on a CUDA device: as exact as on the CPU, TF32 off inside it, a bf16 training step around it.

CI has no GPU, so the CUDA tests are skipped there; on a GPU machine run ``pytest tests/teleport``
(and ``TLAB_TEST_DEVICE=cuda pytest tests/teleport`` to run every teleport test on the GPU). The TF32
test runs everywhere: the flags it checks exist on a CPU build too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from teleport import TeleportConfig, Teleporter, teleport_batch
from tests.teleport.families import CASES, OPEN, Case
from tests.teleport.test_uses import assert_exact

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
FLAGS = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)


def on(case: Case, device: str) -> Case:
    return Case(case.model.to(device), case.x.to(device), case.y.to(device), case.moved, case.loss_fn)


def test_tf32_is_off_inside_a_teleport_and_the_callers_flags_come_back() -> None:
    seen: list[tuple[str, ...]] = []

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        seen.append(tuple(f.fp32_precision for f in FLAGS))
        return F.cross_entropy(out, y)

    saved = [f.fp32_precision for f in FLAGS]
    try:
        for f in FLAGS:
            f.fp32_precision = "tf32"  # what a training script on an A100/H100 typically sets
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        teleport_batch(model, loss_fn, torch.randn(4, 6), torch.randint(0, 3, (4,)), TeleportConfig(steps=2))
        assert seen and set(seen) == {("ieee", "ieee")}
        assert [f.fp32_precision for f in FLAGS] == ["tf32", "tf32"]
    finally:
        for f, value in zip(FLAGS, saved, strict=True):
            f.fp32_precision = value


@cuda
@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_model_family_teleports_exactly_on_cuda_as_on_the_cpu(name: str) -> None:
    with torch.device("cpu"):  # built on the CPU also under TLAB_TEST_DEVICE=cuda: the CUDA RNG draws others
        cpu, gpu = CASES[name](), on(CASES[name](), "cuda")  # seeded builders: the same weights and batch
        expected = teleport_batch(cpu.model, cpu.loss_fn, cpu.x, cpu.y, OPEN)
    untouched = assert_exact(gpu)  # drift <= 1e-9, the listed parameters move, the untouched stay
    assert all(p.device.type == "cuda" for p in gpu.model.parameters())
    assert set(untouched) == set(expected.untouched)
    for (n, a), (_, b) in zip(gpu.model.named_parameters(), cpu.model.named_parameters(), strict=True):
        assert torch.allclose(a.cpu(), b, rtol=1e-6, atol=1e-9), f"{name}: {n} differs from the CPU teleport"


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 10))


@cuda
def test_bf16_autocast_training_with_a_float32_teleport_between_steps() -> None:
    """Train under bf16 autocast on the GPU; the teleport between steps runs in float32, TF32 off, and keeps
    the batch loss to float32 round-off while ‖∇L‖² rises; training goes on from the teleported weights."""
    torch.manual_seed(0)
    model = small_cnn().cuda()
    x, y = torch.randn(32, 3, 8, 8, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def train_step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    first = [train_step() for _ in range(3)]
    before = copy.deepcopy(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # the caller's autocast does not reach the teleport
        report = teleport_batch(model, F.cross_entropy, x[:8], y[:8], TeleportConfig(steps=5, lr=0.05, cap=1e6))
    assert report.steps > 0 and report.grad_norm_sq_after > report.grad_norm_sq_before
    assert abs(report.loss_after - report.loss_before) <= 1e-4 * abs(report.loss_before)
    with torch.no_grad():
        assert abs(float(F.cross_entropy(model(x[:8]), y[:8])) - report.loss_before) <= 1e-4 * report.loss_before
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters(), strict=True))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    later = [train_step() for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(first + later)))


@cuda
def test_bases_on_cuda_match_the_cpu_svd_and_prove_the_cpus_full_ranks() -> None:
    from teleport.geometry.bases import compute_bases, compute_basis, whole_spans
    from teleport.geometry.projection import project

    torch.manual_seed(7)
    reps = [torch.randn(512, 256, dtype=torch.float32) for _ in range(3)] + [torch.randn(64, 300)]
    reps.append(torch.randn(512, 40) @ torch.randn(40, 256))  # rank 40 of 256: the eigenvalues' route
    on_gpu = compute_bases([r.cuda() for r in reps], 1.0)
    for rep, b in zip(reps, on_gpu, strict=True):  # (an H200 failed this once; the messages say which check)
        ref = compute_basis(rep, 1.0, route="svd")
        assert (b.rank, b.route) == (ref.rank, b.route) and b.route in ("cols", "gram"), (tuple(rep.shape), b.rank,
                                                                                          ref.rank, b.route)
        g = torch.randn(8, rep.shape[0])
        off = float((project(g.cuda(), b).cpu() - project(g, ref)).abs().max())
        assert off <= 1e-4, (tuple(rep.shape), b.route, off)
    assert sorted(whole_spans([r.cuda() for r in reps])) == sorted(whole_spans(reps)) == [0, 1, 2, 3]


@cuda
def test_the_squared_norm_on_cuda_is_one_multi_tensor_kernel_as_exact_as_the_dots() -> None:
    from teleport.hvp.objective import squared_norm

    torch.manual_seed(5)
    grads = [torch.randn(1024, 1024), torch.randn(3000), torch.randn(64, 64, dtype=torch.float64)]
    reference = sum(float(g.double().square().sum()) for g in grads)
    assert float(squared_norm([g.cuda() for g in grads])) == pytest.approx(reference, rel=1e-6)
    assert float(squared_norm(grads)) == pytest.approx(reference, rel=1e-5)  # the CPU's float32 dots: 2.6e-6


@cuda
@pytest.mark.parametrize("ascent", ["host", "device"])  # cuda_graph: see test_on_device
@pytest.mark.parametrize("hvp", ["exact", "difference"])
def test_an_ascent_step_on_cuda_syncs_the_host_at_most_once(ascent: str, hvp: str) -> None:
    """CUDA's sync debug mode warns at every host sync: each try of a step (an accepted step, or one a back-off
    shortened) syncs at most once, counted as the difference between 8 and 4 steps so the setup cancels. On an
    H200 the host guard once counted 5 syncs for 4 more steps; the message lists where each sync was made, and the
    tries and teleport host reads beside them."""
    import warnings

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)).cuda()
    x, y = torch.randn(16, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")

    def syncs(steps: int) -> tuple[list[str], int, int]:
        config = TeleportConfig(steps=steps, lr=1e-4, cap=1e12, loss_tol=1e9, ascent=ascent, hvp=hvp)
        teleporter = Teleporter(copy.deepcopy(model), F.cross_entropy, config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                report = teleporter.teleport(x, y)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert report.steps == steps
        where = [f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        return where, report.steps + report.backoffs, teleporter.reads.count

    syncs(1)  # the process's first teleport: a one-off sync of torch's own (torch/cuda/__init__.py on an H200)
    (s8, tries8, reads8), (s4, tries4, reads4) = syncs(8), syncs(4)
    assert len(s8) - len(s4) <= tries8 - tries4, \
        f"syncs 8 steps {s8}, 4 steps {s4}; tries {tries8}, {tries4}; teleport host reads {reads8}, {reads4}"
