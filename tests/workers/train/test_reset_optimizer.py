"""``teleport.reset_optimizer`` in our loop (``workers.train.loop``): after a teleport the optimizer's state (Adam's
moments and step count) starts afresh, and without the setting it carries on."""

from __future__ import annotations

import pytest
from torch.optim.optimizer import register_optimizer_step_pre_hook

from api_schemas import build_spec
from workers.train.context import RunContext
from workers.train.loop import train
from workers.train.sinks import MemorySink

STEPS = 5  # optimizer steps an epoch (max_steps_per_epoch)


def fresh_steps(reset: bool) -> list[int]:
    """The optimizer steps that began with no state at all (the first, and each right after a reset)."""
    spec = build_spec({
        "model": {"kind": "mlp", "hidden": [16]},
        "dataset": {"name": "digits", "max_train": 200, "max_test": 100},
        "optimizer": {"name": "adam", "lr": 0.01},
        "training": {"epochs": 3, "batch_size": 32, "device": "cpu", "max_steps_per_epoch": STEPS},
        "teleport": {"epochs": [1], "batches": 1, "steps": 2, "batch_size": 16, "budget": None,
                     "reset_optimizer": reset},
    })
    empty: list[bool] = []
    hook = register_optimizer_step_pre_hook(lambda opt, *_: empty.append(not opt.state))
    sink = MemorySink()
    try:
        train(spec, RunContext(sink=sink))
    finally:
        hook.remove()
    assert [r["epoch"] for r in sink.records if r["kind"] == "teleport"] == [1]  # it teleported, before epoch 1
    assert len(empty) == 3 * STEPS
    return [step for step, was_empty in enumerate(empty) if was_empty]


@pytest.mark.parametrize(("reset", "fresh"), [(True, [0, STEPS]), (False, [0])])
def test_reset_optimizer_clears_the_state_after_a_teleport_and_only_then(reset: bool, fresh: list[int]) -> None:
    assert fresh_steps(reset) == fresh
