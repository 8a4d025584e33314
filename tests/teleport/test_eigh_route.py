"""``teleport.geometry.eigh_route``: the bases' batched eigh on the device or on the host's cores, measured and
chosen; either
route gives the same bases, so a teleport stays exact whichever runs."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from teleport import TeleportConfig, Teleporter
from teleport.geometry import eigh_route
from teleport.geometry.bases import compute_bases, whole_spans
from teleport.geometry.blocks import build_blocks
from teleport.geometry.capture import UseRecorder, trainable
from teleport.geometry.eigh_route import EighRoutes
from teleport.geometry.layer_bases import representations
from teleport.hvp.objective import objective
from teleport.modes import evaluating

pytestmark = pytest.mark.usefixtures("float64")


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """Two torch threads (the suite runs on one): the host route's pool has two, and a choice to make."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def low_rank_model() -> tuple[nn.Module, Tensor, Tensor]:
    """Linear layers on inputs of rank 3 (12 samples of 8 features): every R is of rank ≤ 4 (the bias's ones
    row too), so no certificate proves one and all go to the eigh; three share one shape (a batch of 3 Grams)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    x = torch.randn(12, 3) @ torch.randn(3, 8)
    return model, x, torch.randint(0, 4, (12,))


def reps_of(model: nn.Module, x: Tensor, y: Tensor) -> list[Tensor]:
    with evaluating(model):
        names, params = trainable(model)
        recorder = UseRecorder(names, params)
        objective(model, nn.functional.cross_entropy, x, y, params, None, 1.0, recorder, False)
        return representations(build_blocks(recorder.uses)[0])[0]


def grams(b: int = 3, n: int = 24, rank: int = 9) -> Tensor:
    torch.manual_seed(1)
    r = torch.randn(b, 40, rank) @ torch.randn(b, rank, n)  # (b, d, N) of rank 9
    return r.mT @ r


def projector(vecs: Tensor, lam: Tensor, tol: float = 1e-9) -> Tensor:
    kept = vecs[..., lam > tol * lam.max()]
    return kept @ kept.mT


def test_the_host_route_decomposes_as_torch_does() -> None:
    g = grams()
    (lam_d, vec_d), (lam_h, vec_h) = eigh_route.on_device(g), eigh_route.on_host(g)
    assert lam_h.device == g.device and vec_h.shape == vec_d.shape
    torch.testing.assert_close(lam_h, lam_d, rtol=0, atol=1e-10 * float(lam_d.abs().max()))
    for j in range(g.shape[0]):  # the span of the nonzero eigenvalues' vectors: what a basis keeps
        torch.testing.assert_close(projector(vec_h[j], lam_h[j]), projector(vec_d[j], lam_d[j]), rtol=0, atol=1e-10)


def test_eigh_times_each_route_once_and_keeps_the_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counted(name: str, delay: float):
        run = getattr(eigh_route, f"on_{name}")

        def fn(g: Tensor) -> tuple[Tensor, Tensor]:
            calls.append(name)
            time.sleep(delay)
            return run(g)
        return fn

    monkeypatch.setattr(eigh_route, "on_device", counted("device", 0.05))
    monkeypatch.setattr(eigh_route, "on_host", counted("host", 0.0))
    routes = EighRoutes()
    g = grams()
    lam, _ = routes.eigh(g)
    assert calls == ["device", "device", "host", "host"]  # each warm, then timed
    (choice,) = routes.report().values()
    assert choice["route"] == "host" and choice["seconds"]["device"] > choice["seconds"]["host"]
    calls.clear()
    torch.testing.assert_close(routes.eigh(g)[0], lam)
    assert calls == ["host"]  # the choice is kept for this key
    kept = EighRoutes()
    kept.load_state_dict(routes.state_dict())  # a resumed teleporter keeps it
    torch.testing.assert_close(kept.eigh(g)[0], lam)
    assert calls == ["host", "host"]
    routes.eigh(grams(b=2))
    assert calls[2:] == ["device", "device", "host", "host"]  # another shape is measured on its own


def test_one_cpu_thread_is_one_route() -> None:
    torch.set_num_threads(1)
    g = grams()
    routes = EighRoutes()
    torch.testing.assert_close(routes.eigh(g)[0], torch.linalg.eigh(g)[0], rtol=0, atol=0)
    assert routes.report() == {}
    with pytest.raises(ValueError, match="eigh route 'gpu'"):
        EighRoutes("gpu")


def test_rank_deficient_bases_are_the_same_by_either_route() -> None:
    model, x, y = low_rank_model()
    reps = reps_of(model, x, y)
    assert len(whole_spans(reps)) == 0 and len(reps) == 4  # every R by the eigh
    by = {}
    for route in eigh_route.ROUTES:
        by[route] = compute_bases(reps, 1.0, routes=EighRoutes(route))
    for dev, host in zip(by["device"], by["host"], strict=True):
        assert (dev.rank, dev.kept is None) == (host.rank, host.kept is None) and dev.rank == 4
        torch.testing.assert_close(host.kept @ host.kept.T, dev.kept @ dev.kept.T, rtol=0, atol=1e-12)


def test_a_teleport_by_the_host_route_is_exact_and_the_device_routes() -> None:
    model, x, y = low_rank_model()
    config = TeleportConfig(steps=3, lr=0.05, cap=1e9, loss_tol=1.0, check_first=False)
    moved = {}
    for route in eigh_route.ROUTES:
        net = copy.deepcopy(model)
        report = Teleporter(net, nn.functional.cross_entropy, config, eigh_route=route).teleport(x, y)
        assert report.steps == 3 and report.grad_norm_sq_after > report.grad_norm_sq_before
        assert abs(report.loss_after - report.loss_before) <= 1e-9 * abs(report.loss_before)
        moved[route] = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    assert float((moved["device"] - torch.cat([p.detach().reshape(-1) for p in model.parameters()])).abs().max()) > 1e-6
    torch.testing.assert_close(moved["host"], moved["device"], rtol=0, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the host route's copies to and from a GPU")
def test_the_host_route_of_cuda_grams_comes_back_to_the_gpu() -> None:
    g = grams().cuda()
    (lam_d, vec_d), (lam_h, vec_h) = eigh_route.on_device(g), eigh_route.on_host(g)
    assert vec_h.device == g.device and lam_h.device == g.device
    for j in range(g.shape[0]):
        torch.testing.assert_close(projector(vec_h[j], lam_h[j]), projector(vec_d[j], lam_d[j]), rtol=0, atol=1e-10)
    routes = EighRoutes()
    routes.eigh(g)
    (choice,) = routes.report().values()
    assert choice["route"] in eigh_route.ROUTES and set(choice["seconds"]) == set(eigh_route.ROUTES)
