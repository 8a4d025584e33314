"""Presets: every one validates, and the paper presets carry the hyperparameter table's values exactly."""

from __future__ import annotations

import json

import pytest

from api_schemas import build_spec, load_spec
from api_schemas.presets import PRESET_NOTES, PRESETS, preset
from api_schemas.spec import CNNModel, MLPModel, ResNetModel, TransformerModel

DATASETS = ["mnist", "fashion_mnist", "cifar10", "cifar100", "tiny_imagenet", "smnist", "electricity",
            "traffic", "ptb"]
OPTIMIZERS = ["sgd", "momentum", "adagrad", "adam"]
PAPER = [f"paper/{d}-{o}" for d in DATASETS for o in OPTIMIZERS]
EXTRA = ["paper/mnist-symmetry-sgd", "digits/teleport", "digits/baseline", "digits/symmetry", "digits/cnn"]


def test_names() -> None:
    assert set(PRESETS) == set(PAPER) | set(EXTRA)
    assert set(PRESET_NOTES) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates(name: str) -> None:
    spec = build_spec(PRESETS[name])
    assert spec.training.batch_size == 32
    assert spec.teleport.epochs == [0, 1, 2, 3, 4]
    assert (spec.teleport.batches, spec.teleport.steps, spec.teleport.tau) == (32, 8, 1.0)
    assert json.loads(json.dumps(PRESETS[name])) == PRESETS[name]  # plain JSON data
    assert load_spec(name) == spec  # reachable by name through spec_io


# (preset, eta_prim, eta_tele, T_prim (epochs), n, CAP): rows of the paper's table
TABLE_ROWS = [
    ("paper/mnist-sgd", 2e-4, 2e-1, 100, 32, 5),
    ("paper/fashion_mnist-adam", 2e-4, 2e-1, 100, 32, 5),
    ("paper/cifar10-momentum", 1e-4, 3e-3, 100, 256, 40),
    ("paper/cifar10-adam", 1e-5, 3e-3, 300, 256, 40),
    ("paper/cifar100-adagrad", 1e-4, 3e-3, 400, 256, 40),
    ("paper/cifar100-adam", 3e-5, 3e-3, 400, 256, 40),
    ("paper/tiny_imagenet-sgd", 2e-4, 3e-3, 400, 32, 40),
    ("paper/tiny_imagenet-adam", 5e-5, 3e-3, 400, 32, 40),
    ("paper/smnist-momentum", 1e-3, 3e-3, 400, 32, 10),
    ("paper/smnist-adam", 1e-4, 3e-3, 400, 32, 10),
    ("paper/electricity-adagrad", 1e-4, 3e-3, 50, 32, 10),
    ("paper/traffic-adam", 1e-4, 3e-3, 50, 32, 10),
    ("paper/ptb-sgd", 2e-4, 5e-2, None, 32, 5),
    ("paper/ptb-adam", 5e-5, 5e-2, None, 32, 5),
]


@pytest.mark.parametrize(("name", "lr", "tele_lr", "epochs", "n", "cap"), TABLE_ROWS,
                         ids=[r[0] for r in TABLE_ROWS])
def test_table_values(name: str, lr: float, tele_lr: float, epochs: int | None, n: int, cap: float) -> None:
    spec = build_spec(PRESETS[name])
    assert spec.optimizer.name == name.rsplit("-", 1)[1]
    assert spec.optimizer.lr == lr
    assert spec.teleport.lr == tele_lr
    assert spec.teleport.batch_size == n
    assert spec.teleport.cap == cap
    assert spec.teleport.method == "nullspace" and spec.teleport.enabled
    if epochs is not None:
        assert spec.training.epochs == epochs
        assert spec.training.max_steps_per_epoch is None


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_ptb_runs_twenty_thousand_steps(opt: str) -> None:
    t = build_spec(PRESETS[f"paper/ptb-{opt}"]).training
    assert t.max_steps_per_epoch is not None
    assert t.epochs * t.max_steps_per_epoch == 20_000


@pytest.mark.parametrize("name", PAPER)
def test_models_datasets_and_warmup(name: str) -> None:
    spec = build_spec(PRESETS[name])
    dataset = name.removeprefix("paper/").rsplit("-", 1)[0]
    assert spec.dataset.name == dataset and spec.dataset.root == f"data/{dataset}"
    model = spec.model
    if dataset in {"mnist", "fashion_mnist"}:
        assert isinstance(model, MLPModel) and model.hidden == [1024, 1024] and model.activation == "relu"
    elif dataset in {"cifar10", "cifar100"}:
        assert isinstance(model, CNNModel) and model.channels == [16, 32, 64]
    elif dataset == "tiny_imagenet":
        assert isinstance(model, ResNetModel) and model.channels == [64, 64, 64, 128, 128, 128, 256, 256, 256]
    else:
        assert isinstance(model, TransformerModel)
        shape = (model.heads, model.head_dim, model.layers)
        assert shape == ((2, 64, 2) if dataset == "smnist" else (4, 64, 4))
    cnn = dataset in {"cifar10", "cifar100", "tiny_imagenet"}
    assert spec.training.warmup_steps == (40 if cnn else 0)


def test_demo_and_symmetry_presets() -> None:
    tele, base = build_spec(PRESETS["digits/teleport"]), build_spec(PRESETS["digits/baseline"])
    assert tele.dataset.name == base.dataset.name == "digits"
    assert tele.teleport.enabled and not base.teleport.enabled
    assert tele.model == base.model and tele.optimizer == base.optimizer and tele.training == base.training
    sym = build_spec(PRESETS["digits/symmetry"])
    assert sym.teleport.method == "symmetry" and sym.model.activation == "leaky_relu"  # type: ignore[union-attr]
    cnn = build_spec(PRESETS["digits/cnn"])
    assert isinstance(cnn.model, CNNModel) and cnn.model.channels == [16, 32]
    paper_sym = build_spec(PRESETS["paper/mnist-symmetry-sgd"])
    assert isinstance(paper_sym.model, MLPModel) and paper_sym.model.hidden == [16, 10]
    assert paper_sym.teleport.method == "symmetry" and paper_sym.dataset.name == "mnist"
    # the null-space side of the same comparison is one override away
    flipped = build_spec(PRESETS["paper/mnist-symmetry-sgd"], ["teleport.method=nullspace"])
    assert flipped.teleport.method == "nullspace"


def test_preset_returns_a_copy() -> None:
    copy = preset("paper/mnist-sgd")
    copy["optimizer"]["lr"] = 1.0
    assert PRESETS["paper/mnist-sgd"]["optimizer"]["lr"] == 2e-4
    with pytest.raises(KeyError, match="paper/mnist-sgd"):
        preset("paper/nope")
