"""The learning-rate schedule, gradient clipping and gradient accumulation of the built-in loop: the rate each step
trains with, a resumed run that goes on as if never stopped, a clip that bounds every step, accumulated batches that
step as one batch of them would, and DDP replicas that stay identical."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from api_schemas import ExperimentSpec, SpecError, build_spec
from api_schemas.spec import OptimizerSpec
from api_schemas.sweeps import SweepSubmit, trial_spec
from teleport.distributed import Collective, TorchDistributed
from tests.workers.train.test_local import _Checkpointing, tiny
from workers.train.build import build_parts, lr_factor, seed_everything
from workers.train.context import RunContext, detached_copy
from workers.train.loop import train
from workers.train.sinks import MemorySink, NullSink

STEPS = 10  # digits, 300 training samples, batch 32: 10 steps an epoch


def scheduled(epochs: int = 3, clip: float | None = None, **optimizer: Any) -> ExperimentSpec:
    base = tiny(epochs=epochs, teleport={"enabled": False}, warmup_steps=4, grad_clip_norm=clip)
    opt = {"name": "sgd", "lr": 0.1, "schedule": "cosine", "lr_warmup_steps": 6, "final_lr_ratio": 0.1, **optimizer}
    return build_spec({**base.model_dump(mode="json"), "optimizer": opt})


def records(spec: ExperimentSpec, kind: str = "epoch") -> list[dict[str, Any]]:
    sink = MemorySink()
    train(spec, RunContext(sink=sink))
    return [r for r in sink.records if r["kind"] == kind]


# --------------------------------------------------------------------------------- the shape


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_a_decaying_schedule_climbs_through_its_warmup_then_falls_to_its_final_ratio(schedule: str) -> None:
    spec = OptimizerSpec(schedule=schedule, lr_warmup_steps=4, final_lr_ratio=0.2)
    f = [lr_factor(spec, s, 20) for s in range(25)]
    assert f[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # (s + 1) / 5, then the peak
    assert all(a >= b for a, b in zip(f[4:], f[5:], strict=False))  # never rises after the warm-up
    assert f[19] == pytest.approx(0.2) and f[24] == pytest.approx(0.2)  # the last step's, and held past it
    middle = 0.2 + 0.8 * (0.6 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * 0.4)))
    assert f[10] == pytest.approx(middle)  # 6 of the 15 decaying steps done


def test_a_constant_rate_is_one_after_its_warmup_whatever_its_final_ratio() -> None:
    spec = OptimizerSpec(lr_warmup_steps=3, final_lr_ratio=0.1)  # unused: a sweep may compare constant with cosine
    assert [lr_factor(spec, s, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    with pytest.raises(SpecError, match="optimizer.final_lr_ratio"):
        build_spec({"optimizer": {"final_lr_ratio": 1.5}})
    with pytest.raises(SpecError, match="training.grad_clip_norm"):
        build_spec({"training": {"grad_clip_norm": 0}})


# ------------------------------------------------------------------------------- in the loop


def test_each_epoch_trains_at_the_rate_of_its_steps_warmup_passes_included() -> None:
    spec = scheduled()
    total = 4 + 3 * STEPS  # training.warmup_steps' steps count
    warm = records(spec, "warmup")
    assert warm[0]["lr"] == pytest.approx(0.1 * lr_factor(spec.optimizer, 3, total))
    epochs = records(spec)
    assert [r["lr"] for r in epochs] == pytest.approx([0.1 * lr_factor(spec.optimizer, 4 + (e + 1) * STEPS - 1, total)
                                                       for e in range(3)])
    assert epochs[-1]["lr"] == pytest.approx(0.01)  # the last step: lr x final_lr_ratio
    assert "grad_norm" not in epochs[0]  # no clipping, nothing said of it
    assert "lr" not in records(tiny(epochs=1, teleport={"enabled": False}))[0]  # a constant rate is not said


class _Kept(_Checkpointing):
    """Keeps a copy of every state (as a job's driver writes it), not the live tensors the loop goes on changing."""

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        super().save(detached_copy(state), metrics)


def test_a_resumed_run_goes_on_along_the_schedule_as_if_never_stopped() -> None:
    whole = _Kept()
    train(scheduled(clip=0.5), whole)
    assert [s["optimizer_steps"] for s in whole.saved] == [4 + STEPS, 4 + 2 * STEPS, 4 + 3 * STEPS]
    resumed = _Kept(resume=whole.saved[0])  # stopped after epoch 0 (preempted, a lost node) and started again
    train(scheduled(clip=0.5), resumed)
    for name, value in whole.saved[-1]["model"].items():
        assert torch.equal(resumed.saved[-1]["model"][name], value), name
    assert [h["lr"] for h in resumed.saved[-1]["history"]] == [h["lr"] for h in whole.saved[-1]["history"]]
    old = {k: v for k, v in whole.saved[0].items() if k != "optimizer_steps"}  # from before the count was kept
    again = _Kept(resume=old)
    train(scheduled(clip=0.5), again)
    assert torch.equal(again.saved[-1]["model"]["layers.0.weight"], whole.saved[-1]["model"]["layers.0.weight"])


def test_a_resumed_trial_follows_its_mutated_lr_along_the_schedule() -> None:
    first = _Kept()
    train(scheduled(epochs=1), first)
    resumed = _Kept(resume=first.saved[-1])
    train(scheduled(lr=0.4), resumed)  # PBT: another trial's checkpoint, this trial's lr
    spec = scheduled(lr=0.4)
    last = resumed.saved[-1]["history"][-1]["lr"]
    assert last == pytest.approx(0.4 * lr_factor(spec.optimizer, 4 + 3 * STEPS - 1, 4 + 3 * STEPS))
    assert resumed.saved[-1]["optimizer"]["param_groups"][0]["initial_lr"] == 0.4


def test_a_fork_with_other_steps_an_epoch_goes_on_from_its_epoch_of_its_own_schedule() -> None:
    parent = _Kept()
    train(scheduled(), parent)  # 10 steps an epoch: the checkpoint after epoch 0 has taken 4 + 10
    child_spec = scheduled(epochs=3)
    child_spec.training.grad_accumulation = 2  # the fork's epochs take 5 steps: epoch 1 starts at its step 4 + 5
    child = _Kept(resume=parent.saved[0])
    train(child_spec, child)
    total = 4 + 3 * 5
    assert [h["lr"] for h in child.saved[-1]["history"][1:]] == pytest.approx(
        [0.1 * lr_factor(child_spec.optimizer, 4 + (e + 1) * 5 - 1, total) for e in (1, 2)])
    assert child.saved[-1]["optimizer_steps"] == total  # the parent's count (14) would have ended the schedule at 24


# ---------------------------------------------------------------------------------- clipping


def test_a_clipped_step_moves_the_weights_at_most_lr_times_the_clip() -> None:
    # plain SGD, constant lr: each step moves the weights by lr x the clipped gradient, so N steps move them by
    # at most N x lr x clip (the clip is far below the gradients' norm: every step is clipped)
    spec = build_spec({**tiny(epochs=1, teleport={"enabled": False}, grad_clip_norm=1e-3).model_dump(mode="json")})
    seed_everything(spec.training.seed)
    _, start, _ = build_parts(spec, NullSink(), spec.training.seed)
    before = torch.cat([p.detach().reshape(-1) for p in start.parameters()])
    run = _Checkpointing()
    sink = MemorySink()
    run.sink = sink
    train(spec, run)
    after = torch.cat([v.reshape(-1) for k, v in run.saved[-1]["model"].items()])
    moved = float((after - before).norm())
    assert 0 < moved <= STEPS * 0.1 * 1e-3 * (1 + 1e-5)
    epoch = next(r for r in sink.records if r["kind"] == "epoch")
    assert epoch["clipped"] == 1.0 and epoch["grad_norm"] > 1e-3
    loose = records(build_spec({**spec.model_dump(mode="json"), "training": {
        **spec.training.model_dump(mode="json"), "grad_clip_norm": 1e6}}))[0]
    assert loose["clipped"] == 0.0 and loose["grad_norm"] > epoch["grad_norm"] * 0.5
    unclipped = records(tiny(epochs=1, teleport={"enabled": False}))[0]
    assert loose["train_loss"] == unclipped["train_loss"]  # a clip no step reaches changes nothing


# ----------------------------------------------------------------------------- accumulation


def accumulating(batch_size: int, accumulate: int, epochs: int = 2, **training: Any) -> ExperimentSpec:
    """Adam on digits in float64, no teleport: one step's gradient is the mean over its samples whatever the split."""
    base = tiny(epochs=epochs, teleport={"enabled": False}, batch_size=batch_size, grad_accumulation=accumulate,
                dtype="float64", **training)
    return build_spec({**base.model_dump(mode="json"), "optimizer": {"name": "adam", "lr": 0.01}})


@pytest.mark.parametrize(("batch_size", "accumulate"), [(16, 2), (8, 4), (4, 8)])
def test_accumulated_batches_step_as_one_batch_of_them_would(batch_size: int, accumulate: int) -> None:
    # 300 samples: 10 batches of 32 (the last 12) against 19 of 16, 38 of 8, 75 of 4 in steps of 32 samples (the
    # last step the same 12): each step's gradient is the same mean, so Adam takes the same steps
    whole, split = _Kept(), _Kept()
    train(accumulating(32, 1), whole)
    train(accumulating(batch_size, accumulate), split)
    assert [s["optimizer_steps"] for s in split.saved] == [STEPS, 2 * STEPS]
    for name, value in whole.saved[-1]["model"].items():
        assert torch.allclose(split.saved[-1]["model"][name], value, rtol=0, atol=1e-12), name
    losses = [[h["train_loss"] for h in run.saved[-1]["history"]] for run in (whole, split)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-12)  # the mean over the samples, whatever the batches


def test_the_last_short_step_weighs_its_samples_alike() -> None:
    # with 16 x 4 the pass's last step is two batches of 16 and one of 12 (300 = 4 x 64 + 44): the 12 weigh as
    # the others' samples, not a third of the step; with 20 x 3 the pass ends on a full step (300 = 5 x 60)
    for batch_size, accumulate, whole_batch in ((16, 4, 64), (20, 3, 60)):
        whole, split = _Kept(), _Kept()
        train(accumulating(whole_batch, 1, epochs=1), whole)
        train(accumulating(batch_size, accumulate, epochs=1), split)
        for name, value in whole.saved[-1]["model"].items():
            assert torch.allclose(split.saved[-1]["model"][name], value, rtol=0, atol=1e-12), (batch_size, name)


def test_max_steps_per_epoch_and_the_schedule_count_optimizer_steps() -> None:
    spec = build_spec({**accumulating(8, 4, max_steps_per_epoch=3, warmup_steps=2).model_dump(mode="json"),
                       "optimizer": {"name": "sgd", "lr": 0.1, "schedule": "linear"}})
    run = _Kept()
    sink = MemorySink()
    run.sink = sink
    train(spec, run)
    assert [s["optimizer_steps"] for s in run.saved] == [2 + 3, 2 + 6]
    assert run.saved[-1]["history"][-1]["lr"] == 0.0  # the linear decay's last step: the run's 8th
    warmup = next(r for r in sink.records if r["kind"] == "warmup")
    assert warmup["steps"] == 2


# ------------------------------------------------------------------------------------ DDP


class _Rank(RunContext):
    """One rank of a 2-process gloo group: the model DDP-wrapped (kept, to read its weights), its gradient
    all-reduces counted (a comm hook), no checkpoints."""

    net: nn.Module | None = None
    all_reduces: int = 0

    @property
    def comm(self) -> Collective | None:
        return TorchDistributed()

    def prepare_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counted(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses a hook annotated otherwise
            self.all_reduces += 1
            return allreduce_hook(state, bucket)

        self.net = nn.parallel.DistributedDataParallel(model)
        self.net.register_comm_hook(None, counted)
        return self.net


def _train_rank(rank: int, spec_json: str, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        sink = MemorySink()
        ctx = _Rank(rank=rank, world_size=2, sink=sink)
        train(ExperimentSpec.model_validate_json(spec_json), ctx, threads=1)
        assert ctx.net is not None
        lrs = [r["lr"] for r in sink.records if r["kind"] == "epoch"]
        torch.save({"lrs": lrs, "weights": ctx.net.module.state_dict(), "all_reduces": ctx.all_reduces},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_replicas_stay_identical_under_a_schedule_clipping_accumulation_and_teleport(tmp_path: Path) -> None:
    spec = scheduled(epochs=2, clip=0.05)  # the gradients' norms are over 0.05: most steps clip
    spec = build_spec({**spec.model_dump(mode="json"), "teleport": tiny().teleport.model_dump(mode="json"),
                       "training": {**spec.training.model_dump(mode="json"), "grad_accumulation": 2}})
    mp.spawn(_train_rank, args=(spec.model_dump_json(), str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["lrs"] == ranks[1]["lrs"] and len(ranks[0]["lrs"]) == 2
    steps = 4 + 2 * 3  # 150 samples a rank: 5 batches of 32, 3 steps an epoch
    assert ranks[0]["lrs"][-1] == pytest.approx(0.1 * lr_factor(spec.optimizer, steps - 1, steps))
    assert [r["all_reduces"] for r in ranks] == [steps, steps]  # once a step, not once a batch (no_sync)
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(ranks[1]["weights"][name], value), name


def test_a_sweep_compares_schedules_and_clips_with_one_final_ratio() -> None:
    sweep = SweepSubmit.model_validate({
        "base": scheduled().model_dump(mode="json"), "searcher": "grid",
        "search_space": {"optimizer.schedule": {"grid": ["constant", "cosine", "linear"]},
                         "training.grad_clip_norm": {"grid": [0.5, None]}}})
    trials = [trial_spec(sweep.base.model_dump(mode="json"), point) for point in sweep.grid_points()]
    assert {(t.optimizer.schedule, t.training.grad_clip_norm) for t in trials} == {
        (s, c) for s in ("constant", "cosine", "linear") for c in (0.5, None)}
    assert {t.optimizer.final_lr_ratio for t in trials} == {0.1}  # the base's, unused by the constant trials


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gpt_trains_with_the_lm_recipe_accumulated_and_teleports_on_its_level_set(
        precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # examples/tiny_lm's GPT with lm_payoff's recipe (AdamW, warm-up, cosine to 0.1 x lr, clip 1.0, teleport before
    # epoch 0), its batches accumulated in pairs
    from benchmarks.lm_payoff_runs import EXAMPLE, lm_spec

    monkeypatch.syspath_prepend(str(EXAMPLE))
    base = lm_spec("adamw_recipe", True, "cpu", quick=True)
    spec = build_spec({**base.model_dump(mode="json"), "training": {
        **base.training.model_dump(mode="json"), "grad_accumulation": 2, "precision": precision, "device": "cpu"}})
    sink = MemorySink()
    train(spec, RunContext(sink=sink), threads=1)
    epochs = [r for r in sink.records if r["kind"] == "epoch"]
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["grad_norm"]) for r in epochs)
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    assert epochs[-1]["lr"] == pytest.approx(0.003 * 0.1)  # the cosine's end: lr x final_lr_ratio
    teleports = [r for r in sink.records if r["kind"] == "teleport"]
    assert teleports and all(r["epoch"] == 0 for r in teleports)
    for t in teleports:  # outside autocast, in float32: the loss on its batch kept
        assert abs(t["loss_after"] - t["loss_before"]) <= spec.teleport.loss_tol * abs(t["loss_before"]) * 1.01
