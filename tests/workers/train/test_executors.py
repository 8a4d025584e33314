"""Layer-parallel bases: the Ray-task executor returns the serial executor's bases."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teleport import SerialExecutor, TeleportConfig, ThreadExecutor, compute_basis, teleport_batch
from workers.train.executors import PARALLEL_MIN_WORK, AutoExecutor, RayTaskExecutor, basis_work, make_executor


def reps() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    low = torch.randn(48, 6, generator=g) @ torch.randn(6, 200, generator=g)  # Gram route, rank 6
    return [low, torch.randn(80, 30, generator=g), torch.randn(33, 33, generator=g)]


@pytest.mark.slow
def test_ray_tasks_return_the_serial_bases(ray_local: object) -> None:
    items = reps()
    serial = SerialExecutor().map(lambda r: compute_basis(r, 0.99), items)
    remote = RayTaskExecutor(min_work=0.0).map(lambda r: compute_basis(r, 0.99), items)
    for a, b in zip(serial, remote, strict=True):
        assert (a.dim, a.rank, a.route) == (b.dim, b.rank, b.route)
        assert a.captured_variance == pytest.approx(b.captured_variance, rel=1e-6)  # float32, 1 vs 2 threads
        for x, y in [(a.kept, b.kept), (a.free, b.free)]:
            assert (x is None) == (y is None)
            if x is not None:  # the same subspace (bases may differ by a rotation): equal projectors
                assert isinstance(y, torch.Tensor)
                assert torch.allclose(x @ x.T, y @ y.T, atol=1e-4)


@pytest.mark.slow
def test_teleport_through_ray_tasks_matches_serial(ray_local: object) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)).double()
    x, y = torch.randn(24, 20, dtype=torch.float64), torch.randint(0, 5, (24,))
    twin = copy.deepcopy(model)
    cfg = TeleportConfig(steps=3, lr=0.3, cap=1e6)
    a = teleport_batch(model, F.cross_entropy, x, y, cfg)
    b = teleport_batch(twin, F.cross_entropy, x, y, cfg, executor=make_executor("ray"))
    assert a.layers == b.layers and a.steps == b.steps
    assert a.grad_norm_sq_after == pytest.approx(b.grad_norm_sq_after, rel=1e-9)


def test_auto_keeps_small_layers_serial_and_shares_big_ones() -> None:
    assert basis_work(torch.zeros(256, 256)) >= PARALLEL_MIN_WORK > basis_work(torch.zeros(64, 32))
    auto = AutoExecutor()
    assert isinstance(auto.choose([torch.zeros(64, 32)] * 8), SerialExecutor)
    assert isinstance(auto.choose([torch.zeros(1024, 256), torch.zeros(64, 8)]), SerialExecutor)
    assert isinstance(auto.choose([torch.zeros(256, 256)] * 2), ThreadExecutor)  # one node: threads
    with pytest.raises(ValueError, match="teleport.parallel"):
        make_executor("gpu")
