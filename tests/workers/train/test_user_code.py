"""The user's own model, data and loss through factories, in this process: ``tlab run --local --code DIR`` with the
example package, and each way a package can be wrong as one line naming the user's file and line."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from api_schemas import build_spec
from workers.train.build import build_parts
from workers.train.loop import run_local
from workers.train.sinks import MemorySink
from workers.train.user_code import UserCodeError, add_code_dir

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "tiny_lm"
_names = itertools.count()

DATA = '''
import torch
from torch.utils.data import TensorDataset


def blobs(n=64, classes=3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])


def floats(n=32):
    x = torch.randn(n, 4)
    return TensorDataset(x[:24], x[:24, :2]), TensorDataset(x[24:], x[24:, :2])
'''


def package(tmp_path: Path, models: str, data: str = DATA) -> tuple[str, Path]:
    """A fresh package ``mylab<N>`` (its own name: modules are cached per interpreter) with models.py and
    data.py, its directory on sys.path as --code puts it."""
    name = f"mylab{next(_names)}"
    root = tmp_path / "code"
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (root / name / "models.py").write_text(textwrap.dedent(models))
    (root / name / "data.py").write_text(textwrap.dedent(data))
    add_code_dir(root)
    return name, root


def spec_for(name: str, factory: str = "build", args: dict | None = None, loss: str | None = None,
             data_factory: str = "blobs") -> object:
    return build_spec({
        "model": {"kind": "custom", "factory": f"{name}.models:{factory}", "args": args or {}},
        "dataset": {"name": "custom", "factory": f"{name}.data:{data_factory}"},
        "training": {"epochs": 1, "batch_size": 16, **({"loss": loss} if loss else {})},
        "teleport": {"enabled": False},
    })


GOOD = '''
from torch import nn


def build(width=8, classes=3):
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, classes))
'''


def test_run_local_with_code_dir_trains_the_example_lm_with_teleport(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "workers.cli", "run", str(EXAMPLE / "spec.yaml"), "--local", "--code", str(EXAMPLE),
           "--out", str(out), "--no-progress", "--set", "training.epochs=2", "teleport.epochs=[0]",
           "teleport.budget=null", "dataset.args.max_chars=6000", "training.max_steps_per_epoch=4"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["kind"] == "start")
    assert start["task"] == "lm" and start["dataset"] == "tiny_lm.data:python_source" and start["model"] == "custom"
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]
    teleports = [r for r in records if r["kind"] == "teleport"]
    assert teleports and any(r["steps"] > 0 for r in teleports)  # the tied LM could move
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_test_ppl"] > 1 and summary["epochs"] == 2


HF_GPT2 = '''
import transformers


def gpt2(vocab=40, width=16):
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=width, n_layer=1, n_head=2,
                                     bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config)  # answers with a ModelOutput, not a tensor
'''


def test_a_factory_may_return_a_transformers_model_as_it_is(tmp_path: Path) -> None:
    # its ModelOutput is read as its logits: the loss, the evaluation's perplexity and teleport all take them
    name, _ = package(tmp_path, HF_GPT2)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    ids = (np.arange(4000) * 7) % 40
    ids[:3600].astype(np.uint16).tofile(corpus / "train.bin")
    ids[3600:].astype(np.uint16).tofile(corpus / "val.bin")
    spec = build_spec({
        "model": {"kind": "custom", "factory": f"{name}.models:gpt2"},
        "dataset": {"name": "tokens", "root": str(corpus), "seq_len": 16},
        "optimizer": {"name": "adamw", "lr": 0.01}, "training": {"epochs": 2, "batch_size": 32},
        "teleport": {"epochs": [0], "batches": 2, "batch_size": 1, "steps": 2, "cap": 1e6, "budget": None},
    })
    summary = run_local(spec, tmp_path / "run", progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    teleports = [r for r in records if r["kind"] == "teleport"]
    assert len(teleports) == 2 and all(r["steps"] > 0 for r in teleports)
    assert all(abs(r["loss_after"] - r["loss_before"]) <= 1e-3 * r["loss_before"] for r in teleports)
    losses = [r["train_loss"] for r in records if r["kind"] == "epoch"]
    assert losses[1] < losses[0] and summary["final_test_ppl"] < 40  # below a uniform guess over the vocabulary


def test_the_hf_lm_example_prepares_its_token_files_and_trains_a_llama_with_teleport(tmp_path: Path) -> None:
    example = REPO / "examples" / "hf_lm"
    done = subprocess.run([sys.executable, str(example / "prepare.py"), str(tmp_path / "data"), "--modules",
                           "json.decoder"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "val.bin" in done.stdout, done.stderr
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "workers.cli", "run", str(example / "spec.yaml"), "--local", "--code", str(example),
           "--out", str(out), "--no-progress", "--set", f"dataset.root={tmp_path / 'data'}", "training.epochs=2",
           "training.max_steps_per_epoch=4", "teleport.budget=null"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["kind"] == "start")
    assert start["task"] == "lm" and start["dataset"] == "tokens" and start["model"] == "custom"
    teleports = [r for r in records if r["kind"] == "teleport"]
    assert teleports and all(r["grad_norm_sq_after"] > r["grad_norm_sq_before"] for r in teleports)
    assert any(r["name"].endswith("mlp.down_proj") and r["free"] > 0 for r in teleports[0]["layers"])
    assert "model.norm.weight" in teleports[0]["untouched"]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]


def test_factories_build_model_data_and_loss(tmp_path: Path) -> None:
    name, _ = package(tmp_path, GOOD)
    data, model, loss_fn = build_parts(spec_for(name, args={"width": 5}), MemorySink(), 0)
    assert data.task == "classification" and data.num_classes == 3 and data.input_shape == (6,)
    assert model[0].out_features == 5 and loss_fn.__name__ == "classification_loss"
    floats, _, mse = build_parts(spec_for(name, data_factory="floats", args={"classes": 2}), MemorySink(), 0)
    assert floats.task == "regression" and floats.output_dim == 2 and mse.__name__ == "regression_loss"


@pytest.mark.parametrize(("models", "factory", "args", "expected"), [
    ("import torch\n\ndef build():\n    return undefined_name\n", "build", {},
     r"^{pkg}/models\.py:4: NameError: name 'undefined_name' is not defined$"),
    ("def build(:\n    pass\n", "build", {}, r"^{pkg}/models\.py:1: SyntaxError: "),
    ("import not_a_module_anywhere\n", "build", {}, r"^{pkg}/models\.py:1: ModuleNotFoundError: "),
    (GOOD, "biuld", {}, r"^model\.factory {pkg}\.models:biuld: {pkg}/models\.py has no 'biuld'"),
    (GOOD, "build", {"widht": 3}, r"^{pkg}/models\.py:5: TypeError: .* does not take these model\.args .*widht"),
    ("def build():\n    return [1, 2]\n", "build", {},
     r"^{pkg}/models\.py:1: model\.factory .* returned a list, not a torch\.nn\.Module"),
], ids=["name_error", "syntax_error", "import_error", "missing_function", "wrong_signature", "wrong_type"])
def test_a_broken_package_fails_in_one_line_naming_the_file_and_line(tmp_path: Path, models: str, factory: str,
                                                                     args: dict, expected: str) -> None:
    import re

    name, _ = package(tmp_path, models)
    sink = MemorySink()
    with pytest.raises(UserCodeError) as err:
        build_parts(spec_for(name, factory, args), sink, 0)
    line = str(err.value)
    assert "\n" not in line and re.search(expected.format(pkg=name), line), line


def test_the_full_traceback_goes_to_the_log_and_the_module_is_named_when_missing(tmp_path: Path) -> None:
    name, _ = package(tmp_path, "def build():\n    return undefined_name\n")
    sink = MemorySink()
    with pytest.raises(UserCodeError):
        build_parts(spec_for(name), sink, 0)
    logs = [r for r in sink.records if r["kind"] == "log"]
    assert logs and "Traceback (most recent call last)" in logs[0]["traceback"] and "undefined_name" in logs[0][
        "traceback"]
    missing = spec_for(name).model_copy(update={"model": spec_for("nosuchpkg").model})
    with pytest.raises(UserCodeError, match=r"^model\.factory nosuchpkg\.models:build: no module named 'nosuchpkg'"):
        build_parts(missing, MemorySink(), 0)


def test_datasets_and_losses_that_do_not_fit_are_refused_by_name(tmp_path: Path) -> None:
    bad_data = DATA + "\n\ndef single():\n    return [1, 2, 3]\n\n\ndef triples():\n    return [(1, 2, 3)], [(1, 2)]\n"
    name, _ = package(tmp_path, GOOD, bad_data)
    with pytest.raises(UserCodeError, match=r"data\.py:\d+: dataset\.factory .*single returned a list, not \(train"):
        build_parts(spec_for(name, data_factory="single"), MemorySink(), 0)
    with pytest.raises(UserCodeError, match=r"gives items of type tuple, not \(x, y\) pairs"):
        build_parts(spec_for(name, data_factory="triples"), MemorySink(), 0)
    with pytest.raises(ValueError, match=r"training\.loss=mse needs float targets"):
        build_parts(spec_for(name, loss="mse"), MemorySink(), 0)
    with pytest.raises(UserCodeError, match=r"training\.loss nosuch\.mod:fn: no module named 'nosuch'"):
        build_parts(spec_for(name, loss="nosuch.mod:fn"), MemorySink(), 0)
