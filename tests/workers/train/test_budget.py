"""teleport.budget: a run's teleports are shortened or skipped to stay within their share of its wall clock."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from api_schemas.spec_io import build_spec
from teleport import TeleportReport
from workers.train.budget import TeleportBudget, cut_message
from workers.train.context import RunContext
from workers.train.loop import train
from workers.train.sinks import MemorySink


def report(seconds: float, steps: int) -> TeleportReport:
    return TeleportReport(1.0, 1.0, 1.0, 2.0, steps, 0, "steps", seconds)


def test_allowance_keeps_teleport_within_its_share_of_the_projected_run() -> None:
    budget = TeleportBudget(share=0.2, epochs=10)
    # 2 epochs took 4 s outside teleport: the run's 10 take 20 s, teleport may spend 0.2/0.8 of that
    assert budget.allowance(train_seconds=4.0, epochs_done=2) == pytest.approx(5.0)
    assert TeleportBudget(share=None, epochs=10).allowance(4.0, 2) == math.inf
    before = TeleportBudget(share=0.2, epochs=10, probe_epoch_s=1.0)  # no epoch yet: the probe's estimate
    assert before.allowance(0.0, 0) == pytest.approx(2.5)


def test_steps_are_cut_to_what_fits_and_a_batch_is_skipped_when_none_does() -> None:
    budget = TeleportBudget(share=0.2, epochs=10)
    budget.record(report(seconds=0.9, steps=8))  # 9 units in 0.9 s: 0.1 s per unit
    assert budget.unit_seconds() == pytest.approx(0.1)
    assert budget.steps_for_batch(8, spent=0.0, train_seconds=4.0, epochs_done=2) == 8  # 5 s left
    assert budget.steps_for_batch(8, spent=4.55, train_seconds=4.0, epochs_done=2) == 3  # 0.45 s: 4 units
    assert budget.steps_for_batch(8, spent=4.85, train_seconds=4.0, epochs_done=2) == 0  # < 2 units: skip
    assert TeleportBudget(share=None, epochs=1).steps_for_batch(8, 1e9, 0.0, 0) == 8  # no budget: no cut
    # ranks average their numbers first: the decision is the same on all of them
    seen: list[list[float]] = []

    def agree(values: list[float]) -> list[float]:
        seen.append(values)
        return [0.45, 0.1]

    assert budget.steps_for_batch(8, spent=0.0, train_seconds=4.0, epochs_done=2, agree=agree) == 3
    assert seen == [[pytest.approx(5.0), pytest.approx(0.1)]]


def test_the_cut_is_said_in_one_line() -> None:
    assert cut_message(3, (4, 8), (2, 8), 0.1) == "teleport at epoch 3 shortened to 2 batches: budget 10 %"
    assert cut_message(0, (4, 8), (0, 8), 0.1) == "teleport at epoch 0 skipped: budget 10 %"
    assert cut_message(1, (4, 8), (4, 3), 0.25) == \
        "teleport at epoch 1 shortened to batches of as few as 3 steps: budget 25 %"
    assert cut_message(1, (4, 8), (2, 3), 0.1) == "teleport at epoch 1 shortened to 2 batches, the shortest 3 of " \
                                                  "its 8 steps: budget 10 %"


def spec(budget: float | None) -> Any:
    return build_spec({
        "model": {"kind": "mlp", "hidden": [32]},
        "dataset": {"name": "digits", "max_train": 200, "max_test": 100},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "training": {"epochs": 3, "batch_size": 32, "seed": 0},
        "teleport": {"epochs": [0, 1, 2], "batches": 2, "steps": 2, "batch_size": 32, "cap": 50.0, "budget": budget},
    })


def run(budget: float | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    sink = MemorySink()
    summary = train(spec(budget), RunContext(sink=sink))
    return sink.records, summary


def test_a_budget_no_teleport_fits_skips_each_and_says_so() -> None:
    records, summary = run(1e-9)
    assert not [r for r in records if r["kind"] == "teleport"]
    cuts = [r for r in records if r["kind"] == "budget"]
    assert [(c["epoch"], c["batches"], c["steps"]) for c in cuts] == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert all(c["message"] == f"teleport at epoch {c['epoch']} skipped: budget 1e-07 %" for c in cuts)
    assert summary["teleport_batches"] == 0 and summary["teleport_cuts"] == 3 and summary["teleport_budget"] == 1e-9
    # the budget's probe is one forward + backward: training is the same as a run without teleport
    plain = train(spec(None).model_copy(update={"teleport": spec(None).teleport.model_copy(
        update={"enabled": False})}), RunContext(sink=MemorySink()))
    assert summary["final_train_loss"] == plain["final_train_loss"]


def test_a_whole_run_budget_cuts_nothing() -> None:
    records, summary = run(1.0)
    assert [(r["epoch"], r["batch"]) for r in records if r["kind"] == "teleport"] == \
        [(e, b) for e in range(3) for b in range(2)]
    assert not [r for r in records if r["kind"] == "budget"] and summary["teleport_cuts"] == 0


def test_an_own_loops_teleport_keeps_the_budget_from_its_first_reported_epoch(tmp_path: Path) -> None:
    """ctx.teleport in the user's loop: before any epoch is reported nothing tells the run's length (its teleport
    runs whole); from then on a budget no teleport fits skips each, with a budget event."""
    from workers.train.loop import run_local
    from workers.train.user_code import add_code_dir

    add_code_dir(Path(__file__).resolve().parents[3] / "examples" / "own_loop")
    spec = build_spec({
        "training": {"entrypoint": "own_loop.loop:train", "entrypoint_args": {"width": 16, "samples": 256},
                     "epochs": 3, "batch_size": 64},
        "optimizer": {"name": "adam", "lr": 0.01},
        "teleport": {"epochs": [0, 1, 2], "batches": 2, "batch_size": 32, "steps": 2, "cap": 50.0, "budget": 1e-9},
    })
    sink = MemorySink()
    summary = run_local(spec, tmp_path / "run", progress=False, sink=sink)
    assert [r["epoch"] for r in sink.records if r["kind"] == "teleport"] == [0, 0]
    assert [(r["epoch"], r["batches"]) for r in sink.records if r["kind"] == "budget"] == [(1, 0), (2, 0)]
    assert summary["teleport_cuts"] == 2 and summary["teleport_budget"] == 1e-9 and summary["teleport_batches"] == 2


def test_a_sweep_may_search_the_budget_and_its_bounds_are_checked() -> None:
    from pydantic import ValidationError

    from api_schemas.presets import PRESETS
    from api_schemas.sweeps import SweepSubmit

    ok = SweepSubmit.model_validate({"base": PRESETS["digits/teleport"],
                                     "search_space": {"teleport.budget": {"grid": [0.05, 0.1, None]}}})
    assert ok.search_space["teleport.budget"] == {"grid": [0.05, 0.1, None]}
    with pytest.raises(ValidationError, match="teleport.budget: Input should be less than or equal to 1"):
        SweepSubmit.model_validate({"base": PRESETS["digits/teleport"],
                                    "search_space": {"teleport.budget": {"grid": [0.05, 2.0]}}})


def test_the_first_batch_calibrates_with_one_step_whatever_the_probe_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that calls teleport nearly free (as a GPU's launch-bound step makes it) does not buy the first batch
    its full steps: one step measures the unit, the batches after it are sized from that."""
    import workers.train.teleporting as teleporting

    budget = TeleportBudget(share=0.1, epochs=10, probe_epoch_s=1.0, probe_unit_s=1e-9)
    assert budget.calibrating and budget.steps_for_batch(8, 0.0, 0.0, 0) == 1
    budget.record(report(seconds=0.05, steps=1))  # 2 units in 0.05 s
    assert not budget.calibrating and budget.steps_for_batch(8, 0.05, 0.0, 0) == 8  # 1.06 s left: 42 units
    assert TeleportBudget(share=1.0, epochs=10, probe_epoch_s=1.0, probe_unit_s=1.0).steps_for_batch(8, 0, 0, 0) == 8
    assert budget.steps_for_batch(8, 1.08, 0.0, 0) == 0  # what was measured: no unit left

    monkeypatch.setattr(teleporting, "FIRST_UNIT_PER_STEP", 1e-9)
    # 99 %: the second batch always fits whatever the first cost on a loaded machine (with 50 % it once did not, and
    # its honest cut failed the last assertion)
    records, summary = run(0.99)
    tele = [r for r in records if r["kind"] == "teleport"]
    assert (tele[0]["epoch"], tele[0]["steps"], tele[0]["calibration"]) == (0, 1, True)
    assert not any(r.get("calibration") for r in tele[1:])
    assert not [r for r in records if r["kind"] == "budget" and r["epoch"] == 0 and r["batches"] == 2], \
        "the calibration batch is not a cut"


def test_a_teleport_at_cap_on_every_batch_says_once_what_to_change(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    """An LM's ‖∇L‖² is far over the default CAP: every batch stops before its first step. The run says so once
    (a ``hint`` record, printed on a local run's console), with the ‖∇L‖² seen and the setting to change."""
    from workers.train.loop import run_local

    at_cap = spec(None).model_copy(update={"teleport": spec(None).teleport.model_copy(update={"cap": 1e-6})})
    sink = MemorySink()
    run_local(at_cap, tmp_path / "run", progress=True, sink=sink)
    tele = [r for r in sink.records if r["kind"] == "teleport"]
    assert {r["batch"] for r in tele} == {0} and all(r["steps"] == 0 and r["stop_reason"] == "cap" for r in tele)
    (skipped,) = [r for r in sink.records if r.get("reason") == "no_move"]  # each epoch stopped at its first batch
    assert "≥ cap 1e-06): its next batches skipped" in skipped["message"]
    hints = [r for r in sink.records if r["kind"] == "hint"]
    assert [(h["epoch"], h["reason"]) for h in hints] == [(0, "cap")]
    low = min(r["grad_norm_sq_before"] for r in tele if r["epoch"] == 0)
    assert hints[0]["message"].startswith(f"teleport at epoch 0: every batch's ‖∇L‖² ({low:.3g} to ")
    assert "raise teleport.cap above" in hints[0]["message"]
    assert hints[0]["message"].endswith("to let teleport move, or set teleport.cap: null with teleport.cap_ratio: 2 "
                                        "(each batch stopped at 2x its own)")
    err = capsys.readouterr().err
    assert f"hint: {hints[0]['message']}" in err and f"budget: {skipped['message']}" in err
    records, _ = run(None)  # teleport that moves says nothing of the cap
    assert not [r for r in records if r["kind"] == "hint" and r["reason"] == "cap"]


def test_teleport_steps_too_small_to_matter_are_told_once_with_the_rise_seen() -> None:
    """Every step taken at teleport.lr without a back-off, ‖∇L‖² up by under 10 %: η is too small for the model (the
    default 0.2 on a char LM: +1 %). The run says so once, with the rise and the setting to raise. η 0.03 raises this
    MLP's ‖∇L‖² by at most 8e-5, far above float32's rounding of it: at η 1e-5 (1e-9, under that rounding) the
    ascent rule's verdict was the CPU's rounding, and one machine's backed off (an AMD EPYC's, 2026-12-03)."""
    base = spec(None)
    timid = base.model_copy(update={"teleport": base.teleport.model_copy(update={"lr": 0.03})})
    sink = MemorySink()
    train(timid, RunContext(sink=sink))
    tele = [r for r in sink.records if r["kind"] == "teleport"]
    assert tele and all(r["stop_reason"] == "steps" and not r["backoffs"] for r in tele)
    hints = [r for r in sink.records if r["kind"] == "hint"]
    assert [(h["epoch"], h["reason"]) for h in hints] == [(0, "small_steps")]
    rise = max(r["grad_norm_sq_after"] / r["grad_norm_sq_before"] for r in tele if r["epoch"] == 0) - 1
    assert hints[0]["message"].startswith(f"teleport at epoch 0: every step was taken without a back-off, yet ‖∇L‖² "
                                          f"rose by at most {rise:.1%} (")
    assert hints[0]["message"].endswith("teleport moved too little to matter; set teleport.rise: 1.5 with "
                                        "teleport.cap_ratio: 2 in place of teleport.lr (now 0.03): each batch's "
                                        "‖∇L‖² raised to about 2x its own, in a step sized from its own slope "
                                        "whatever the model's scale (docs/algorithm.md)")


@pytest.mark.parametrize(("optimizer", "epochs", "said", "rise"),
                         [("adam", [0, 1, 2], True, None), ("adamw", [1], True, None), ("adam", [0], False, None),
                          ("adam", [0, 5], False, None), ("momentum", [0, 1, 2], False, None),
                          ("adam", [0, 1, 2], False, 0.3)])
def test_adam_teleporting_after_epoch_0_is_told_once_at_the_start(optimizer: str, epochs: list[int],
                                                                   said: bool, rise: float | None) -> None:
    """Adam's step does not grow with ‖∇L‖: teleports after the first cost time and seldom save any (measured at the
    paper's η, docs/algorithm.md). A run that asks for them says so once, before its first epoch; epoch 5 of a
    3-epoch run never comes, so it does not count. With teleport.rise the measurements disagree: nothing is said."""
    base = spec(None)
    s = base.model_copy(update={"optimizer": base.optimizer.model_copy(update={"name": optimizer, "lr": 1e-3}),
                                "teleport": base.teleport.model_copy(update={"epochs": epochs, "rise": rise})})
    sink = MemorySink()
    train(s, RunContext(sink=sink))
    hints = [(i, r) for i, r in enumerate(sink.records) if r["kind"] == "hint" and r["reason"] != "small_steps"]
    assert [r["reason"] for _, r in hints] == (["adaptive_optimizer"] if said else [])
    if said:
        first_epoch = next(i for i, r in enumerate(sink.records) if r["kind"] == "epoch")
        assert hints[0][0] < first_epoch and "consider teleport.epochs: [0]" in hints[0][1]["message"]
        assert hints[0][1]["message"].startswith(f"teleport with {optimizer} before epochs {epochs}: ")
