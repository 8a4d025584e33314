"""The user's own training loop (``training.entrypoint``) in this process, no Ray: the example package trains
with teleport and reports every epoch once; checkpoint/restore resumes where it stopped (the driver's
checkpoints, as a retried or preempted job); each way the loop can be wrong is one line naming the user's file
and line."""

from __future__ import annotations

import itertools
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from safetensors.torch import load_file

from api_schemas import ExperimentSpec, build_spec
from workers.job.artifacts import export
from workers.on_ray.driver import DriverContext
from workers.train.context import RunContext
from workers.train.loop import run_local, train
from workers.train.own_loop import NoEpochReported
from workers.train.shared import TrainingDiverged
from workers.train.sinks import MemorySink
from workers.train.user_code import UserCodeError, add_code_dir

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "own_loop"
_names = itertools.count()


def example_spec(**training: Any) -> ExperimentSpec:
    return build_spec({
        "training": {"entrypoint": "own_loop.loop:train", "entrypoint_args": {"width": 16, "samples": 256},
                     "epochs": 2, "batch_size": 64, **training},
        "optimizer": {"name": "adam", "lr": 0.01},
        "teleport": {"epochs": [0, 2], "batches": 2, "batch_size": 32, "steps": 2, "cap": 50.0, "budget": None},
    })


def kinds(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == kind]


def test_the_example_trains_with_teleport_and_reports_each_epoch_once(tmp_path: Path) -> None:
    add_code_dir(EXAMPLE)
    sink = MemorySink()
    summary = run_local(example_spec(), tmp_path / "run", progress=False, sink=sink)
    assert [r["epoch"] for r in kinds(sink.records, "epoch")] == [0, 1]
    assert [r["epoch"] for r in kinds(sink.records, "teleport")] == [0, 0]  # teleport.epochs [0, 2], 2 batches
    assert sink.records[0]["kind"] == "start" and sink.records[0]["params"] > 0
    assert all(0 <= r["test_acc"] <= 1 and r["seconds"] > 0 for r in kinds(sink.records, "epoch"))
    assert summary["epochs"] == 2 and summary["teleport_batches"] == 2 and "final_test_acc" in summary
    assert (tmp_path / "run" / "curves.png").is_file()


def test_a_resume_goes_on_from_the_last_checkpoint_and_artifacts_hold_the_model(tmp_path: Path) -> None:
    add_code_dir(EXAMPLE)
    first = MemorySink()
    train(example_spec(), DriverContext(first, tmp_path / "job"))
    assert [r["epoch"] for r in kinds(first.records, "epoch")] == [0, 1]
    again = MemorySink()  # a retried or preempted job: the same run directory, more epochs left
    summary = train(example_spec(epochs=4), DriverContext(again, tmp_path / "job"))
    assert [r["epoch"] for r in kinds(again.records, "epoch")] == [2, 3]
    assert [r["epoch"] for r in kinds(again.records, "teleport")] == [2, 2]
    assert kinds(again.records, "start")[0]["resumed_from_epoch"] == 2
    assert summary["epochs"] == 4 and summary["teleport_batches"] == 4  # the history came back with the state
    names = export(example_spec(epochs=4), [tmp_path / "job"], tmp_path / "artifacts")
    assert "model.safetensors" in names
    weights = load_file(tmp_path / "artifacts" / "model.safetensors")
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}


def loop_package(tmp_path: Path, source: str) -> str:
    """A package ``ownloop<N>`` whose ``loop.py`` is ``source``, on sys.path; returns its name."""
    name = f"ownloop{next(_names)}"
    root = tmp_path / "code"
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (root / name / "loop.py").write_text(textwrap.dedent(source))
    add_code_dir(root)
    return name


def loop_spec(name: str, function: str = "train") -> ExperimentSpec:
    return build_spec({"training": {"entrypoint": f"{name}.loop:{function}", "epochs": 2},
                       "teleport": {"enabled": False}})


@pytest.mark.parametrize(("source", "function", "expected"), [
    ("def train(ctx):\n    pass\n", "trian",
     r"^training\.entrypoint {pkg}\.loop:trian: {pkg}/loop\.py has no 'trian'"),
    ("def train():\n    pass\n", "train",
     r"^{pkg}/loop\.py:1: TypeError: {pkg}\.loop:train must take one argument, the loop's context"),
    ("def train(ctx):\n    for epoch in ctx.epochs():\n        undefined_name\n", "train",
     r"^{pkg}/loop\.py:3: NameError: name 'undefined_name' is not defined$"),
    ("def train(ctx):\n    ctx.report(epoch=0, train_loss=1.0)\n", "train",
     r"^{pkg}/loop\.py:2: ValueError: ctx\.report\(epoch=0\): test_loss missing"),
    ("def train(ctx):\n    ctx.report(epoch=0, train_loss=1.0, test_loss=1.0)\n    ctx.checkpoint({'w': 1})\n",
     "train", r"^{pkg}/loop\.py:3: ValueError: ctx\.checkpoint\(state\): give a dict holding 'model'"),
    ("def train(ctx):\n    ctx.report(epoch=0, train_loss=1.0, test_loss=1.0)\n"
     "    ctx.checkpoint({'model': {}, 'opt': object()})\n",
     "train", r"^{pkg}/loop\.py:3: ValueError: ctx\.checkpoint: state\['opt'\] is a object"),
    ("def train(ctx):\n    ctx.report(epoch=0, train_loss=1.0, test_loss=1.0)\n"
     "    ctx.report(epoch=0, train_loss=1.0, test_loss=1.0)\n",
     "train", r"^{pkg}/loop\.py:3: ValueError: ctx\.report\(epoch=0\): give each epoch once, in order"),
], ids=["missing_function", "wrong_signature", "error_in_loop", "report_without_test_loss", "state_without_model",
        "state_not_plain", "epoch_twice"])
def test_a_broken_loop_fails_in_one_line_naming_the_file_and_line(tmp_path: Path, source: str, function: str,
                                                                  expected: str) -> None:
    name = loop_package(tmp_path, source)
    sink = MemorySink()
    with pytest.raises(UserCodeError) as err:
        train(loop_spec(name, function), DriverContext(sink, tmp_path / "job"))
    line = str(err.value)
    assert "\n" not in line and re.search(expected.format(pkg=name), line), line


def test_a_loop_that_never_reports_fails_saying_to_call_report(tmp_path: Path) -> None:
    name = loop_package(tmp_path, "def train(ctx):\n    for epoch in ctx.epochs():\n        pass\n")
    with pytest.raises(NoEpochReported, match=r"the entrypoint returned without reporting an epoch: call "
                                              r"ctx\.report\(epoch=\.\.\., \.\.\.\)"):
        train(loop_spec(name), DriverContext(MemorySink(), tmp_path / "job"))


def test_the_spec_checks_the_entrypoint_and_counts_it_as_user_code() -> None:
    spec = build_spec({"training": {"entrypoint": "mylab.loop:train", "entrypoint_args": {"width": 8}}})
    assert spec.user_code_fields() == ["training.entrypoint"]
    bad = [({"training": {"entrypoint": "mylab/loop.py"}}, "training.entrypoint"),
           ({"training": {"entrypoint_args": {"width": 8}}}, "training.entrypoint_args is for training.entrypoint"),
           ({"training": {"entrypoint": "mylab.loop:train"},
             "model": {"kind": "mlp", "activation": "leaky_relu"}, "teleport": {"method": "symmetry"}},
            "an own loop (training.entrypoint) teleports with method=nullspace")]
    for raw, expected in bad:
        with pytest.raises((ValidationError, ValueError), match=re.escape(expected)):
            ExperimentSpec.model_validate(raw)


class Recording(RunContext):
    """An in-process context that keeps what Ray Train / Tune would be told."""

    def __init__(self) -> None:
        super().__init__(sink=MemorySink())
        self.saved: list[int] = []
        self.metrics_only: list[int] = []

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        self.saved.append(metrics["epochs"])

    def report_metrics(self, metrics: dict[str, Any]) -> None:
        self.metrics_only.append(metrics["epochs"])


def test_each_epoch_reaches_ray_once_with_or_without_a_checkpoint(tmp_path: Path) -> None:
    body = ("def train(ctx):\n    for epoch in ctx.epochs():\n"
            "        ctx.report(epoch=epoch, train_loss=1.0 / (epoch + 1), test_loss=1.0)\n")
    name = loop_package(tmp_path, body + "        ctx.checkpoint({'model': {}})\n")
    ctx = Recording()
    train(loop_spec(name), ctx)
    assert ctx.saved == [1, 2] and ctx.metrics_only == []  # the metrics ride with the checkpoint
    ctx = Recording()
    summary = train(loop_spec(loop_package(tmp_path, body)), ctx)
    assert ctx.saved == [] and ctx.metrics_only == [1, 2] and summary["final_train_loss"] == 0.5


def test_a_nan_loss_ends_the_run_as_diverged(tmp_path: Path) -> None:
    name = loop_package(tmp_path, "def train(ctx):\n    ctx.report(epoch=0, train_loss=float('nan'), test_loss=1.0)\n")
    sink = MemorySink()
    with pytest.raises(TrainingDiverged, match="training diverged at epoch 0"):
        train(loop_spec(name), RunContext(sink=sink))
    assert kinds(sink.records, "error") and not kinds(sink.records, "epoch")


def test_a_ddp_wrappers_state_dict_is_kept_under_the_bare_models_names(tmp_path: Path) -> None:
    name = loop_package(tmp_path, """
        from torch import nn


        def train(ctx):
            model = ctx.prepare(nn.Sequential(nn.Linear(2, 3)))
            for epoch in ctx.epochs():
                ctx.report(epoch=epoch, train_loss=1.0, test_loss=1.0)
                ctx.checkpoint({"model": {f"module.{k}": v for k, v in model.state_dict().items()}})
        """)
    train(loop_spec(name), DriverContext(MemorySink(), tmp_path / "job"))
    state = DriverContext(MemorySink(), tmp_path / "job").restore()
    assert state is not None and set(state["model"]) == {"0.weight", "0.bias"} == set(state["own"]["model"])


def test_an_own_loop_teleporting_with_adam_after_epoch_0_is_told_once(tmp_path: Path) -> None:
    """The loop hands ``ctx.teleport`` its optimizer (the example does): Adam with teleport.epochs past 0 gets the
    built-in loop's hint once, at its first teleport; the same loop with epochs [0] says nothing."""
    add_code_dir(EXAMPLE)
    told = []
    for epochs in ([0, 1], [0]):
        spec = example_spec()
        spec = spec.model_copy(update={"teleport": spec.teleport.model_copy(update={"epochs": epochs})})
        sink = MemorySink()
        run_local(spec, tmp_path / f"run{len(told)}", progress=False, sink=sink)
        told.append([r["reason"] for r in kinds(sink.records, "hint") if r["reason"] != "small_steps"])
        first_teleport = next(i for i, r in enumerate(sink.records) if r["kind"] == "teleport")
        assert all(i < first_teleport for i, r in enumerate(sink.records) if r["kind"] == "hint"
                   and r["reason"] == "adaptive_optimizer")
    assert told == [["adaptive_optimizer"], []]
