"""A run resumed from its checkpoint takes the teleports the run without the interruption took (float64, 1e-9): the
teleporter's state (the learned aim at CAP, the rank certificate's memory, ...) travels in the checkpoint, through
``torch.save`` and ``torch.load(weights_only=True)`` as a real one does. And a teleport that cannot move stops the
run's teleports: it says so, and the later epochs pay nothing for them."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from api_schemas import ExperimentSpec, build_spec
from workers.train.context import RunContext, plain
from workers.train.loop import train
from workers.train.sinks import MemorySink

KEYS = ("grad_norm_sq_before", "grad_norm_sq_after", "loss_before", "loss_after")


def spec(**teleport: Any) -> ExperimentSpec:
    """Digits, a small MLP in float64, teleports before every epoch aimed at twice each batch's own ‖∇L‖²: each
    aimed step teaches the teleporter's aim, so a teleport depends on the ones before it."""
    return build_spec({
        "model": {"kind": "mlp", "hidden": [64, 64]},
        "dataset": {"name": "digits", "max_train": 200, "max_test": 100},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "training": {"epochs": 4, "batch_size": 32, "seed": 0, "device": "cpu", "dtype": "float64"},
        "teleport": {"epochs": [0, 1, 2, 3], "batches": 2, "steps": 3, "batch_size": 8, "rise": 1.5,
                     "cap": None, "cap_ratio": 2.0, "budget": None, **teleport},
    })


@dataclass
class Checkpoints(RunContext):
    """Records every event, keeps every checkpoint as bytes (what a file would hold), resumes from ``resume``."""

    sink: Any = field(default_factory=MemorySink)
    kept: list[bytes] = field(default_factory=list)
    resume: bytes | None = None

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(plain(state), buffer)
        self.kept.append(buffer.getvalue())

    def restore(self) -> dict[str, Any] | None:
        return None if self.resume is None else torch.load(io.BytesIO(self.resume), weights_only=True)

    def teleports(self) -> list[dict[str, Any]]:
        return [r for r in self.sink.records if r["kind"] == "teleport"]


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert [(r["epoch"], r["batch"], r["steps"], r["backoffs"], r["stop_reason"]) for r in a] == \
        [(r["epoch"], r["batch"], r["steps"], r["backoffs"], r["stop_reason"]) for r in b]
    for x, y in zip(a, b, strict=True):
        for key in KEYS:
            assert x[key] == pytest.approx(y[key], rel=1e-9), (x["epoch"], x["batch"], key)


def test_a_resumed_run_takes_the_teleports_of_the_run_without_the_interruption() -> None:
    whole = Checkpoints()
    train(spec(), whole)
    after = [r for r in whole.teleports() if r["epoch"] >= 2]
    assert len(after) == 4 and any(r["backoffs"] for r in whole.teleports() if r["epoch"] == 0)

    resumed = Checkpoints(resume=whole.kept[1])  # stopped after epoch 1's checkpoint
    train(spec(), resumed)
    _same(resumed.teleports(), after)

    state = torch.load(io.BytesIO(whole.kept[1]), weights_only=True)
    state["teleport_budget"]["teleporter"] = None  # a resume that forgot what the teleports learned
    forgetful = io.BytesIO()
    torch.save(state, forgetful)
    forgot = Checkpoints(resume=forgetful.getvalue())
    train(spec(), forgot)
    changed = [(r["steps"], r["backoffs"]) for r in forgot.teleports()] != [(r["steps"], r["backoffs"]) for r in after]
    assert changed or any(abs(x["grad_norm_sq_after"] - y["grad_norm_sq_after"]) > 1e-6 * y["grad_norm_sq_after"]
                          for x, y in zip(forgot.teleports(), after, strict=True))


def test_a_teleport_at_cap_skips_its_epochs_other_batches_and_checks_first_after() -> None:
    """Every batch's ‖∇L‖² starts above a CAP of 1e-6: epoch 0 stops at its first batch, epoch 1's teleport is skipped,
    epoch 2 stops at its first batch again — decided by a plain forward + backward, the teleporter checks first after a
    batch at CAP — and epoch 3 (of the next 3 to skip) is skipped; the run says so once."""
    run = Checkpoints()
    summary = train(spec(cap=1e-6, cap_ratio=None, rise=None), run)
    assert [(r["epoch"], r["batch"], r["steps"]) for r in run.teleports()] == [(0, 0, 0), (2, 0, 0)]  # 1: skipped
    (said,) = [r for r in run.sink.records if r.get("reason") == "no_move"]
    assert said["epoch"] == 0 and said["stop_reason"] == "cap"
    assert said["message"].startswith("teleport made no move at epoch 0 (‖∇L‖² ")
    assert "≥ cap 1e-06): its next batches skipped, and teleport epochs skipped in doubling runs" in said["message"]
    assert summary["teleport_skipped"] == said["message"] and summary["teleport_skipped_batches"] == 1 + 2 + 1 + 2
    assert all(r["layers"] == [] for r in run.teleports()[1:])  # no basis built: checked first
    resumed = Checkpoints(resume=run.kept[1])
    assert train(spec(cap=1e-6, cap_ratio=None, rise=None), resumed)["teleport_skipped"] == said["message"]
    assert [r for r in resumed.sink.records if r.get("reason") == "no_move"] == []  # said once a run, resumed too


def test_which_no_moves_stop_what() -> None:
    """At CAP before a try: the epoch stops (a later one checks again); no free direction: the run stops; every try
    of every batch of an epoch refused: the run stops; a batch that moved, or one refused beside one at CAP: nothing."""
    from teleport import TeleportReport
    from workers.train.teleport_hints import refused_record, stuck_record

    tp = spec(cap=5.0, cap_ratio=None, rise=None).teleport

    def rep(reason: str, steps: int = 0, backoffs: int = 0) -> TeleportReport:
        return TeleportReport(1.0, 1.0, 11.2, 11.2, steps, backoffs, reason, 0.1)

    said = stuck_record(0, rep("cap"), tp)["message"]
    assert said.startswith("teleport made no move at epoch 0 (‖∇L‖² 11.2 ≥ cap 5)")
    assert stuck_record(2, rep("no_free_directions"), tp)["message"] == (
        "teleport made no move at epoch 2 (no layer has a free direction at teleport.batch_size 8): "
        "the next teleports skipped")
    assert stuck_record(0, rep("cap", backoffs=7), tp) is None  # tries overshot CAP: not at CAP before one
    assert stuck_record(0, rep("cap", steps=1), tp) is None
    assert refused_record(1, [rep("loss_tol", backoffs=7), rep("loss_tol", backoffs=7)])["message"] == (
        "teleport made no move at epoch 1 (every try moved the batch loss past teleport.loss_tol): "
        "the next teleports skipped")
    assert refused_record(1, [rep("loss_tol", backoffs=7), rep("steps", steps=2)]) is None
    assert refused_record(1, [rep("cap", backoffs=7), rep("cap")]) is None


def test_an_epoch_whose_every_try_was_refused_stops_the_runs_teleports() -> None:
    """loss_tol 0 refuses every try of every batch (the loss moves by rounding): the epoch's batches all ran, none
    moved, and no later epoch teleports."""
    run = Checkpoints()
    summary = train(spec(loss_tol=0.0, max_backoff=1), run)
    assert [(r["epoch"], r["steps"]) for r in run.teleports()] == [(0, 0), (0, 0)]
    assert summary["teleport_skipped"].startswith("teleport made no move at epoch 0 (every try moved the batch loss")
