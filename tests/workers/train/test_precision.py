"""``training.precision``: bf16 autocast around each training step's forward and loss; teleport stays in float32."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from api_schemas import ExperimentSpec, build_spec
from workers.train.build import select_device
from workers.train.context import RunContext
from workers.train.loop import train

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


def test_bf16_trains_and_teleports_in_float32_outside_autocast() -> None:
    losses, teleports = run(spec(precision="bf16"))
    assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0]
    assert len(teleports) == 4 and sum(t["steps"] for t in teleports) > 0  # teleport moved weights
    for t in teleports:  # emitted right after teleport_batch: it ran outside the step's autocast
        assert not t["autocast"] and t["stop_reason"] != "not_finite"
        assert abs(t["loss_after"] - t["loss_before"]) <= LOSS_TOL * abs(t["loss_before"])
    fp32, _ = run(spec(precision="fp32"))
    assert losses != pytest.approx(fp32, rel=1e-6)  # the steps did run in bf16 ...
    assert losses == pytest.approx(fp32, rel=0.05)  # ... and learned the same thing


def test_fp32_is_the_default_and_never_enters_autocast() -> None:
    from workers.train.build import autocast

    assert spec().training.precision == "fp32"
    device = select_device(spec().training)
    with autocast(spec().training, device):
        assert not torch.is_autocast_enabled(device.type)  # fp32 steps run exactly as before the option
    with autocast(spec(precision="bf16").training, device):
        assert torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.bfloat16
