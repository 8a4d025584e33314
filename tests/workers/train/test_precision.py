"""``training.precision``: bf16 or fp16 autocast around each training step's forward and loss (fp16's loss scaled by a
GradScaler whose scale is checkpointed); teleport stays in float32."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from api_schemas import ExperimentSpec, SpecError, build_spec
from tests.workers.train.test_schedule import _Kept
from workers.train.build import select_device
from workers.train.context import RunContext
from workers.train.loop import train
from workers.train.stepping import Stepper

LOSS_TOL = 1e-3


def spec(**training: Any) -> ExperimentSpec:
    """Digits, 300 training samples, an MLP [32, 32] on the default device; teleport 2 batches x 3 steps
    before each of 2 epochs."""
    return build_spec({
        "model": {"kind": "mlp", "hidden": [32, 32]},
        "dataset": {"name": "digits", "max_train": 300, "max_test": 200},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "training": {"epochs": 2, "batch_size": 32, "seed": 0, **training},
        "teleport": {"epochs": [0, 1], "batches": 2, "steps": 3, "batch_size": 32, "lr": 0.2, "cap": 50.0,
                     "loss_tol": LOSS_TOL, "budget": None},
    })


class AutocastWatch:
    """A sink that notes, per record, whether autocast was on when the loop emitted it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.records: list[dict[str, Any]] = []

    def emit(self, record: dict[str, Any]) -> None:
        self.records.append({**record, "autocast": torch.is_autocast_enabled(self.device.type)})

    def close(self) -> None:
        pass


def run(s: ExperimentSpec) -> tuple[list[float], list[dict[str, Any]]]:
    """(train loss per epoch, teleport records)."""
    device = select_device(s.training)  # CUDA where one is visible: the same test checks both
    sink = AutocastWatch(device)
    train(s, RunContext(device=device, sink=sink), threads=1)
    return ([r["train_loss"] for r in sink.records if r["kind"] == "epoch"],
            [r for r in sink.records if r["kind"] == "teleport"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_teleports_in_float32_outside_autocast(precision: str) -> None:
    losses, teleports = run(spec(precision=precision))
    assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0]
    assert len(teleports) == 4 and sum(t["steps"] for t in teleports) > 0  # teleport moved weights
    for t in teleports:  # emitted right after teleport_batch: it ran outside the step's autocast
        assert not t["autocast"] and t["stop_reason"] != "not_finite"
        assert abs(t["loss_after"] - t["loss_before"]) <= LOSS_TOL * abs(t["loss_before"])
    fp32, _ = run(spec(precision="fp32"))
    assert losses != pytest.approx(fp32, rel=1e-6)  # the steps did run in bf16 / fp16 ...
    assert losses == pytest.approx(fp32, rel=0.05)  # ... and learned the same thing


def test_fp32_is_the_default_and_never_enters_autocast() -> None:
    from workers.train.build import autocast

    assert spec().training.precision == "fp32"
    device = select_device(spec().training)
    with autocast(spec().training, device):
        assert not torch.is_autocast_enabled(device.type)  # fp32 steps run exactly as before the option
    with autocast(spec(precision="bf16").training, device):
        assert torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.bfloat16
    with autocast(spec(precision="fp16").training, device):
        assert torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.float16
    with pytest.raises(SpecError, match="training.precision=fp16 needs training.dtype=float32"):
        spec(precision="fp16", dtype="float64")


def test_an_fp16_step_whose_gradients_overflow_is_skipped_and_the_scale_lowered() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = Stepper.build(spec(precision="fp16", grad_clip_norm=1.0), opt, model, torch.device("cpu"), 10)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    before = [p.detach().clone() for p in model.parameters()]
    for scale in (1e6, 1.0):  # x 65536: the first loss's gradients pass float16's 65504 in the backward
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y) * scale
        stepper.backward(loss)
        stepper.step()
        opt.zero_grad()
        if scale > 1:
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))  # skipped
            assert stepper.scaler is not None and stepper.scaler.get_scale() == 32768.0  # halved
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))  # the second stepped
    report = stepper.report()
    assert math.isfinite(report["grad_norm"]) and report["clipped"] in (0.0, 1.0)  # the overflow is not averaged in
    assert stepper.state()["optimizer_steps"] == 2 and stepper.state()["grad_scaler"]["scale"] == 32768.0


def test_a_resumed_fp16_run_goes_on_with_its_checkpointed_loss_scale() -> None:
    first = _Kept()
    train(spec(precision="fp16", epochs=1), first, threads=1)
    state = first.saved[-1]
    assert state["grad_scaler"]["scale"] > 0 and state["optimizer_steps"] == 10
    resumed = _Kept(resume={**state, "grad_scaler": {**state["grad_scaler"], "scale": 1024.0}})
    train(spec(precision="fp16"), resumed, threads=1)
    assert resumed.saved[-1]["grad_scaler"]["scale"] == 1024.0  # the checkpoint's, not a fresh 65536
