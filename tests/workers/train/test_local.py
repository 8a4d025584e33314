"""The in-process runner: records, outputs, seeds, divergence, builders, plots and the workers CLI."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from matplotlib.image import imread
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import TensorDataset

from api_schemas import ExperimentSpec, build_spec
from api_schemas.spec import OptimizerSpec, TeleportSpec, TrainingSpec
from plots.curves import plot_bands, plot_curves, read_metrics
from teleport import TeleportConfig
from workers import cli
from workers.train.build import (
    OPTIMIZER_NAMES,
    build_optimizer,
    reset_optimizer_state,
    select_device,
    teleport_config,
)
from workers.train.context import RunContext
from workers.train.loop import evaluate, run_local, train
from workers.train.models import build_model, loss_fn_for
from workers.train.shared import TrainingDiverged
from workers.train.sinks import JsonlSink, MemorySink

EPOCH_KEYS = {"kind", "epoch", "train_loss", "test_loss", "test_acc", "seconds", "teleport_seconds"}
TELEPORT_KEYS = {"epoch", "batch", "loss_before", "loss_after", "grad_norm_sq_before", "grad_norm_sq_after",
                 "steps", "seconds", "layers", "backoffs", "stop_reason", "untouched"}


def tiny(epochs: int = 3, teleport: dict[str, Any] | None = None, **training: Any) -> ExperimentSpec:
    """Digits, 300 training samples, a small MLP; teleport 2 batches x 2 steps before epochs 0 and 1."""
    return build_spec({
        "model": {"kind": "mlp", "hidden": [32, 32]},
        "dataset": {"name": "digits", "max_train": 300, "max_test": 200},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "training": {"epochs": epochs, "batch_size": 32, "seed": 0, "device": "cpu", **training},
        "teleport": {"epochs": [0, 1], "batches": 2, "steps": 2, "batch_size": 32, "lr": 0.2, "cap": 50.0,
                     "budget": None, **(teleport or {})},
    })


def coloured_pixels(png: Path) -> int:
    """Pixels whose RGB channels differ clearly (curves), as opposed to white, black and grey (axes, text)."""
    img = imread(png)[..., :3]  # (H, W, 3) floats in [0, 1]
    return int(((img.max(axis=-1) - img.min(axis=-1)) > 0.25).sum())


# ------------------------------------------------------------------------------- the run


def test_tiny_run_writes_metrics_summary_and_curves(tmp_path: Path) -> None:
    summary = run_local(tiny(), tmp_path, progress=False)
    records = read_metrics(tmp_path / "metrics.jsonl")
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "summary"
    assert records[0]["params"] == summary["params"] > 0
    epochs = [r for r in records if r["kind"] == "epoch"]
    teleports = [r for r in records if r["kind"] == "teleport"]
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    assert all(set(r) == EPOCH_KEYS for r in epochs)
    assert [(t["epoch"], t["batch"]) for t in teleports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(TELEPORT_KEYS <= set(t) for t in teleports)
    assert all({"name", "free", "rank", "input_dim"} <= set(t["layers"][0]) for t in teleports)
    # teleport runs before its epoch's training, so it comes right before that epoch's line
    assert kinds.index("teleport") < kinds.index("epoch")
    seconds = [r["seconds"] for r in epochs]
    assert seconds == sorted(seconds) and 0 < epochs[-1]["teleport_seconds"] < seconds[-1]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    for t in teleports:  # loss kept on the teleport batch (tau = 1), ‖∇L‖² not lowered
        assert t["loss_after"] == pytest.approx(t["loss_before"], rel=1e-3)
        assert t["grad_norm_sq_after"] >= t["grad_norm_sq_before"] * (1 - 1e-4)

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["epochs"] == 3 and saved["final_train_loss"] == epochs[-1]["train_loss"]
    assert saved["best_test_loss"] == min(r["test_loss"] for r in epochs)
    assert saved["best_test_acc"] == max(r["test_acc"] for r in epochs)
    assert saved["teleport_batches"] == 4 and 0 < saved["teleport_share"] < 1
    assert ExperimentSpec.model_validate(saved["spec"]) == tiny()

    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert coloured_pixels(png) > 500


def test_same_seed_gives_the_same_run(tmp_path: Path) -> None:
    def losses(seed: int, name: str) -> list[float]:
        run_local(tiny(epochs=2, seed=seed), tmp_path / name, progress=False)
        records = read_metrics(tmp_path / name / "metrics.jsonl")
        return [r["train_loss"] for r in records if r["kind"] == "epoch"]

    first = losses(0, "a")
    assert losses(0, "b") == first
    assert losses(1, "c") != first


class _Checkpointing(RunContext):
    """Keeps every state ``train`` saves, and hands ``resume`` back as the checkpoint to go on from."""

    def __init__(self, resume: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.saved: list[dict[str, Any]] = []
        self.resume = resume

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        self.saved.append(state)

    def restore(self) -> dict[str, Any] | None:
        return self.resume


def test_a_resumed_run_goes_on_from_the_checkpoint_with_the_specs_optimizer_settings() -> None:
    # what a PBT trial does: another run's weights, epoch and optimizer state, but its own (mutated) lr
    first = _Checkpointing()
    train(tiny(epochs=1), first)
    state = first.saved[-1]
    assert state["epoch"] == 1 and state["optimizer"]["param_groups"][0]["lr"] == 0.1
    mutated = build_spec({**tiny(epochs=2).model_dump(mode="json"), "optimizer": {"name": "sgd", "lr": 0.02}})
    resumed = _Checkpointing(resume=state)
    summary = train(mutated, resumed)
    assert [s["epoch"] for s in resumed.saved] == [2]  # only epoch 1 ran, after the restored epoch 0
    assert resumed.saved[-1]["optimizer"]["param_groups"][0]["lr"] == 0.02  # the spec's, not the checkpoint's
    assert summary["epochs"] == 2 and len(resumed.saved[-1]["history"]) == 2


class _ThreadsSeen(MemorySink):
    """Notes torch's thread count at each record: what the loop trained with."""

    def emit(self, record: dict[str, Any]) -> None:
        super().emit({**record, "threads": torch.get_num_threads()})


def test_every_runner_trains_with_the_threads_its_cpus_pay_for() -> None:
    # a job's driver, a gang's rank, a Ray Train worker and a trial all call train(): whatever OMP_NUM_THREADS
    # the process inherited, the loop runs with resources.cpus_per_worker threads (capped at the cores), then
    # gives the process its own count back
    before = torch.get_num_threads()
    spec = build_spec({**tiny(epochs=1).model_dump(mode="json"), "resources": {"cpus_per_worker": 2}})
    want = min(2, os.cpu_count() or 1)
    torch.set_num_threads(1)
    try:
        sink = _ThreadsSeen()
        train(spec, RunContext(sink=sink))
        assert {r["threads"] for r in sink.records} == {want}, sink.records
        assert torch.get_num_threads() == 1
        kept = _ThreadsSeen()
        train(spec, RunContext(sink=kept), threads=0)  # 0: the process's own count
        assert {r["threads"] for r in kept.records} == {1}
    finally:
        torch.set_num_threads(before)


def test_a_rerun_in_the_same_directory_starts_a_fresh_metrics_file(tmp_path: Path) -> None:
    spec = tiny(epochs=1, teleport={"enabled": False})
    run_local(spec, tmp_path, progress=False)
    run_local(spec, tmp_path, progress=False)
    assert sum(r["kind"] == "epoch" for r in read_metrics(tmp_path / "metrics.jsonl")) == 1


def test_nan_loss_stops_with_training_diverged_naming_the_epoch(tmp_path: Path) -> None:
    spec = build_spec({**tiny(epochs=3).model_dump(), "optimizer": {"name": "sgd", "lr": 1e6},
                       "teleport": {"enabled": False}})
    with pytest.raises(TrainingDiverged, match=r"epoch 0\b.*optimizer\.lr"):
        run_local(spec, tmp_path, progress=False)
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert last["kind"] == "error" and last["epoch"] == 0 and "diverged" in last["message"]
    assert not (tmp_path / "summary.json").exists()


def test_warmup_comes_before_the_first_teleport_and_target_is_reported() -> None:
    sink = MemorySink()
    summary = train(tiny(epochs=2, warmup_steps=12, target_loss=100.0), RunContext(sink=sink))
    kinds = [r["kind"] for r in sink.records]
    assert kinds.index("warmup") < kinds.index("teleport")
    assert next(r for r in sink.records if r["kind"] == "warmup")["steps"] == 12  # more than one pass of 10
    assert summary["epochs_to_target"] == 1 and summary["seconds_to_target"] > 0
    assert train(tiny(epochs=1, target_loss=1e-9), RunContext())["epochs_to_target"] is None


def test_symmetry_teleport_and_optimizer_reset_run() -> None:
    spec = build_spec({**tiny(epochs=2).model_dump(),
                       "model": {"kind": "mlp", "hidden": [24], "activation": "leaky_relu"},
                       "optimizer": {"name": "adam", "lr": 1e-3}})
    spec = spec.model_copy(update={"teleport": spec.teleport.model_copy(
        update={"method": "symmetry", "reset_optimizer": True, "batch_size": 24})})
    sink = MemorySink()
    train(spec, RunContext(sink=sink))
    teleports = [r for r in sink.records if r["kind"] == "teleport"]
    assert len(teleports) == 4 and {t["method"] for t in teleports} == {"symmetry"}


@pytest.mark.parametrize("cap", [2, 3])
def test_max_steps_per_epoch_caps_the_epoch(cap: int) -> None:
    """300 samples in batches of 32 are 10 steps an epoch: the cap stops it after ``cap`` optimizer steps each."""
    steps: list[int] = []
    hook = register_optimizer_step_post_hook(lambda *_: steps.append(1))
    sink = MemorySink()
    try:
        train(tiny(epochs=2, max_steps_per_epoch=cap, teleport={"enabled": False}), RunContext(sink=sink))
    finally:
        hook.remove()
    assert len(steps) == 2 * cap, len(steps)
    assert [math.isfinite(r["train_loss"]) for r in sink.records if r["kind"] == "epoch"] == [True, True]


def test_lm_evaluation_reports_perplexity() -> None:
    model = build_model(build_spec({"model": {"kind": "transformer", "heads": 1, "head_dim": 8, "layers": 1},
                                    "teleport": {"enabled": False}}).model,
                        task="lm", input_shape=(6,), num_classes=11, output_dim=None)
    tokens = torch.randint(0, 11, (10, 7), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    ctx = RunContext()
    loader = ctx.loader(data, 4, shuffle=False, seed=0, epoch=0)
    metrics = evaluate(model, loader, loss_fn_for("lm"), "lm", ctx, torch.float32)
    assert set(metrics) == {"test_loss", "test_ppl"}
    assert metrics["test_ppl"] == pytest.approx(math.exp(metrics["test_loss"]))


# ------------------------------------------------------------------------------ builders


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_optimizer_builds_steps_and_resets(name: str) -> None:
    spec = OptimizerSpec(name=name, lr=0.05, momentum=0.8, betas=(0.8, 0.9), weight_decay=1e-4)
    layer = torch.nn.Linear(3, 2)
    opt = build_optimizer(spec, layer.parameters())
    expected = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
                "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    assert type(opt) is expected
    group = opt.param_groups[0]
    assert group["lr"] == 0.05 and group["weight_decay"] == 1e-4
    if name in ("sgd", "momentum"):
        assert group["momentum"] == (0.8 if name == "momentum" else 0)
    if name in ("adam", "adamw"):
        assert group["betas"] == (0.8, 0.9)
    before = layer.weight.detach().clone()
    layer(torch.ones(4, 3)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(before, layer.weight)
    if name != "sgd":  # plain SGD keeps no state
        assert opt.state
    reset_optimizer_state(opt)
    assert not opt.state
    opt.step()  # and steps again from scratch


def test_teleport_config_and_device_builders() -> None:
    spec = TeleportSpec(steps=3, lr=0.5, cap=7.0, tau=0.9, loss_tol=1e-2, max_backoff=2, ascent="device")
    assert teleport_config(spec) == TeleportConfig(steps=3, lr=0.5, cap=7.0, tau=0.9, loss_tol=1e-2,
                                                   max_backoff=2, ascent="device")
    assert select_device(TrainingSpec(device="cpu")) == torch.device("cpu")
    assert select_device(TrainingSpec(device="auto")).type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="training.device"):
            select_device(TrainingSpec(device="cuda"))


# --------------------------------------------------------------------------------- plots


def test_plots_overlay_runs_and_draw_seed_bands(tmp_path: Path) -> None:
    def records(scale: float, teleport: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in range(5):
            if teleport and e < 2:
                out.append({"kind": "teleport", "epoch": e, "batch": 0, "grad_norm_sq_before": 1.0,
                            "grad_norm_sq_after": 2.0})
            out.append({"kind": "epoch", "epoch": e, "train_loss": scale / (e + 1),
                        "test_loss": scale / (e + 2)})
        return out

    sink = JsonlSink(tmp_path / "m.jsonl")
    for r in records(1.0, True):
        sink.emit(r)
    sink.close()
    assert read_metrics(tmp_path / "m.jsonl") == records(1.0, True)
    nan = {"kind": "epoch", "epoch": 5, "train_loss": float("nan"), "test_loss": 1.0}
    with_nan = [*records(2.0, False), nan]
    plot_curves({"teleport": records(1.0, True), "plain": with_nan}, tmp_path / "c.png", title="t")
    plot_bands({"teleport": [records(1.0, True), records(1.2, True)],
                "plain": [records(2.0, False), records(2.5, False)]}, tmp_path / "b.png")
    for png in ("c.png", "b.png"):
        assert coloured_pixels(tmp_path / png) > 500


# ----------------------------------------------------------------------------------- CLI


# --set takes every PATH=VALUE after it: keep it last, so callers can append more overrides
FAST = ["--no-progress", "--set", "training.epochs=2", "dataset.max_train=200", "dataset.max_test=100",
        "model.hidden=[16]", "teleport.batches=1", "teleport.steps=1", "teleport.epochs=[0]"]


def test_compare_runs_both_variants_per_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["compare", "digits/teleport", "--seeds", "2", "--out", str(tmp_path), *FAST,
                     "training.target_loss=5"])
    assert code == 0
    out = capsys.readouterr().out
    assert "nullspace teleport" in out and "no teleport" in out and "epochs to 5" in out
    result = json.loads((tmp_path / "compare.json").read_text())
    assert set(result["groups"]) == {"nullspace teleport", "no teleport"}
    for group in result["groups"].values():
        assert len(group["runs"]) == 2 and group["stats"]["final_train_loss"]["n"] == 2
        assert group["stats"]["epochs_to_target"]["mean"] == 1
    assert result["groups"]["no teleport"]["stats"]["teleport_share"]["mean"] == 0
    assert coloured_pixels(tmp_path / "compare.png") > 500
    seeds = [json.loads((tmp_path / "no-teleport" / f"seed{s}" / "summary.json").read_text())["spec"]
             for s in range(2)]
    assert [s["training"]["seed"] for s in seeds] == [0, 1]


def test_cli_spec_errors_name_the_field_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", "digits/teleport", "--set", "teleport.tau=2", "optimizer.nam=adam"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("error: teleport.tau:") for line in err)
    assert any(line.startswith("error: optimizer.nam:") for line in err)
    assert cli.main(["run", "no/such-preset", "--local"]) == 2
    assert "tlab presets" in capsys.readouterr().err
    assert cli.main(["run", "digits/teleport"]) == 2  # where to run must be said
    assert "--local" in capsys.readouterr().err
    assert cli.main(["validate", "digits/teleport", "--set", "training.epochs=4"]) == 0
    assert "epochs: 4" in capsys.readouterr().out
    assert cli.main(["presets"]) == 0
    assert "digits/teleport" in capsys.readouterr().out


def test_cli_reports_a_spec_that_does_not_fit_the_data(capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path) -> None:
    code = cli.main(["run", "digits/teleport", "--local", "--out", str(tmp_path), *FAST,
                     "model={kind: transformer}"])
    assert code == 2
    assert "model.kind=transformer" in capsys.readouterr().err


def test_cli_divergence_exits_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = cli.main(["run", "digits/baseline", "--local", "--out", str(tmp_path), *FAST, "optimizer.lr=1e6",
                     "model.hidden=[32,32]"])
    assert code == 1
    assert "diverged at epoch 0" in capsys.readouterr().err
    assert np.isfinite(read_metrics(tmp_path / "metrics.jsonl")[0]["params"])


def test_adamw_decays_matrices_not_biases_or_norm_weights_unless_decay_all() -> None:
    """As nanoGPT and Hugging Face's Trainer: with zero gradients AdamW's only move is its decay, lr x wd x w."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))
    for decay_all, moved in ((False, {"0.weight", "2.weight"}), (True, {n for n, _ in model.named_parameters()})):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1.0)
                p.grad = torch.zeros_like(p)
        opt = build_optimizer(OptimizerSpec(name="adamw", lr=0.1, weight_decay=0.5, decay_all=decay_all),
                              model.parameters())
        opt.step()
        changed = {n for n, p in model.named_parameters() if not torch.all(p == 1.0)}
        assert changed == moved, (decay_all, changed)
        assert torch.allclose(model[2].weight, torch.full((3, 4), 1 - 0.1 * 0.5))


def test_no_progress_still_says_the_runs_hints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Adam with a teleport after epoch 0 gets the schedule hint: on stderr with --no-progress as with the bar."""
    assert cli.main(["run", "digits/teleport", "--local", "--out", str(tmp_path), *FAST, "optimizer.name=adam",
                     "teleport.epochs=[0,1]", "teleport.budget=null"]) == 0
    assert any(line.startswith("hint: teleport with adam") for line in capsys.readouterr().err.splitlines())


def test_compare_takes_the_users_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tlab compare --local --code DIR``: the factories import from DIR (not on sys.path before)."""
    pkg = tmp_path / "code" / "cmpcode"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text("from torch import nn\n\n\ndef build():\n    return nn.Sequential("
                                   "nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {kind: custom, factory: cmpcode.models:build}\ndataset: {name: digits}\n")
    assert cli.main(["compare", str(spec), "--code", str(tmp_path / "code"), "--seeds", "1", "--out",
                     str(tmp_path / "out"), *[a for a in FAST if not a.startswith("model.")]]) == 0
    result = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert {g: len(v["runs"]) for g, v in result["groups"].items()} == {"nullspace teleport": 1, "no teleport": 1}
