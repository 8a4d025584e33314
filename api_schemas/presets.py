"""Presets: one per row of the paper's hyperparameter table, plus fast demos on the offline digits set.

``paper/<dataset>-<optimizer>`` follows Table "Summary table for hyper-parameters of all
experiments" of the paper: ``optimizer.lr`` is eta_prim, ``teleport.lr`` is eta_tele,
``training.epochs`` is T_prim, ``teleport.batch_size`` is n and ``teleport.cap`` is CAP. Shared by
every row (paper, Implementation Details): primary batch size 32, b = 32 teleport batches of
t = 8 steps each, teleport before each of the first 5 epochs, tau = 1 (exact null space), and
40 warm-up steps before the first teleport for the CNN experiments. Real datasets are read from
``data/<name>`` (relative to where the run starts); override with ``--set dataset.root=...``.

Every value is a plain dict that ``api_schemas.spec_io.build_spec`` validates.
"""

from __future__ import annotations

import json
from typing import Any

OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam")

# dataset -> (eta_prim per optimizer (sgd, momentum, adagrad, adam), eta_tele, T_prim per optimizer, n, CAP)
Row = tuple[tuple[float, float, float, float], float, tuple[int, int, int, int], int, float]
PAPER_TABLE: dict[str, Row] = {
    "mnist": ((2e-4, 2e-4, 2e-4, 2e-4), 2e-1, (100, 100, 100, 100), 32, 5),
    "fashion_mnist": ((2e-4, 2e-4, 2e-4, 2e-4), 2e-1, (100, 100, 100, 100), 32, 5),
    "cifar10": ((1e-4, 1e-4, 1e-4, 1e-5), 3e-3, (100, 100, 100, 300), 256, 40),
    "cifar100": ((1e-4, 1e-4, 1e-4, 3e-5), 3e-3, (400, 400, 400, 400), 256, 40),
    "tiny_imagenet": ((2e-4, 2e-4, 2e-4, 5e-5), 3e-3, (400, 400, 400, 400), 32, 40),
    "smnist": ((1e-3, 1e-3, 1e-3, 1e-4), 3e-3, (400, 400, 400, 400), 32, 10),
    "electricity": ((1e-4, 1e-4, 1e-4, 1e-4), 3e-3, (50, 50, 50, 50), 32, 10),
    "traffic": ((1e-4, 1e-4, 1e-4, 1e-4), 3e-3, (50, 50, 50, 50), 32, 10),
    # T_prim here is 20,000 optimizer steps, not epochs: see PTB_EPOCHS x PTB_STEPS_PER_EPOCH
    "ptb": ((2e-4, 2e-4, 2e-4, 5e-5), 5e-2, (20_000, 20_000, 20_000, 20_000), 32, 5),
}

# PTB: 20,000 steps = 200 epochs x 100 steps. 100 is below the batches in one pass over PTB's
# ~930k training tokens (256-token sequences in batches of 32: ~113 batches), so every epoch is
# capped at exactly 100 steps whether the loader cuts disjoint or overlapping windows.
PTB_EPOCHS, PTB_STEPS_PER_EPOCH = 200, 100

CNN_DATASETS = {"cifar10", "cifar100", "tiny_imagenet"}
FIRST_FIVE_EPOCHS = [0, 1, 2, 3, 4]


def _model(dataset: str) -> dict[str, Any]:
    """The paper's architecture for a dataset (Implementation Details)."""
    if dataset in {"mnist", "fashion_mnist"}:
        return {"kind": "mlp", "hidden": [1024, 1024], "activation": "relu"}
    if dataset in {"cifar10", "cifar100"}:
        return {"kind": "cnn", "channels": [16, 32, 64], "kernel_size": 3, "pool": True}
    if dataset == "tiny_imagenet":
        return {"kind": "resnet", "channels": [64, 64, 64, 128, 128, 128, 256, 256, 256]}
    if dataset == "smnist":  # 2 heads x 64, 2 layers, average pooling + 10-way head
        return {"kind": "transformer", "heads": 2, "head_dim": 64, "layers": 2, "pooling": "mean"}
    # electricity, traffic (regression) and ptb (causal LM): 4 heads x 64, 4 layers, no pooling
    return {"kind": "transformer", "heads": 4, "head_dim": 64, "layers": 4}


def _dataset(dataset: str) -> dict[str, Any]:
    data: dict[str, Any] = {"name": dataset, "root": f"data/{dataset}"}
    if dataset in {"electricity", "traffic"}:
        data.update(seq_len=168, horizon=24)  # a week of hourly data -> the value 24 hours later
    elif dataset == "ptb":
        data.update(seq_len=256)
    return data


def _teleport(lr: float, cap: float, n: int, **extra: Any) -> dict[str, Any]:
    return {
        "enabled": True,
        "method": "nullspace",
        "epochs": list(FIRST_FIVE_EPOCHS),
        "batches": 32,
        "steps": 8,
        "batch_size": n,
        "lr": lr,
        "cap": cap,
        "tau": 1.0,
        **extra,
    }


def paper_preset(dataset: str, optimizer: str) -> dict[str, Any]:
    """The raw spec of one row of the paper's hyperparameter table."""
    lrs, tele_lr, epochs, n, cap = PAPER_TABLE[dataset]
    i = OPTIMIZERS.index(optimizer)
    training: dict[str, Any] = {"epochs": epochs[i], "batch_size": 32, "seed": 0}
    if dataset == "ptb":  # T_prim counts steps: 200 epochs x 100 steps = 20,000
        if PTB_EPOCHS * PTB_STEPS_PER_EPOCH != epochs[i]:
            raise ValueError("PTB_EPOCHS x PTB_STEPS_PER_EPOCH must equal the table's 20,000 steps")
        training.update(epochs=PTB_EPOCHS, max_steps_per_epoch=PTB_STEPS_PER_EPOCH)
    if dataset in CNN_DATASETS:
        training["warmup_steps"] = 40
    return {
        "model": _model(dataset),
        "dataset": _dataset(dataset),
        "optimizer": {"name": optimizer, "lr": lrs[i]},
        "training": training,
        "teleport": _teleport(tele_lr, cap, n),
    }


def _digits(model: dict[str, Any], teleport: dict[str, Any], **training: Any) -> dict[str, Any]:
    """A fast demo on scikit-learn's bundled digits (1,797 8x8 images, offline)."""
    return {
        "model": model,
        "dataset": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05},
        "training": {"epochs": 20, "batch_size": 32, "seed": 0, **training},
        "teleport": teleport,
    }


def _build() -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    presets: dict[str, dict[str, Any]] = {}
    notes: dict[str, str] = {}
    for dataset in PAPER_TABLE:
        for optimizer in OPTIMIZERS:
            name = f"paper/{dataset}-{optimizer}"
            presets[name] = paper_preset(dataset, optimizer)
            notes[name] = f"paper table row: {dataset} with {optimizer} (reads the files in data/{dataset})"

    # The paper's comparison with symmetry teleport (after Zhao et al.): a small [16, 10] LeakyReLU
    # MLP on MNIST with the MNIST (SGD) row's rates. For the null-space side of the comparison use
    # --set teleport.method=nullspace on this preset.
    small = paper_preset("mnist", "sgd")
    small["model"] = {"kind": "mlp", "hidden": [16, 10], "activation": "leaky_relu", "negative_slope": 0.1}
    small["teleport"]["method"] = "symmetry"
    presets["paper/mnist-symmetry-sgd"] = small
    notes["paper/mnist-symmetry-sgd"] = "paper's symmetry-teleport comparison: [16, 10] LeakyReLU MLP, MNIST"

    mlp = {"kind": "mlp", "hidden": [256, 256], "activation": "relu"}
    presets["digits/teleport"] = _digits(mlp, _teleport(0.2, 5.0, 32))
    notes["digits/teleport"] = "demo: null-space teleport on digits, MLP [256, 256], SGD (offline, fast)"
    presets["digits/baseline"] = _digits(mlp, {**_teleport(0.2, 5.0, 32), "enabled": False})
    notes["digits/baseline"] = "demo: digits/teleport without teleport, for the side-by-side curve"
    # symmetry teleport is loss-invariant only while the teleport batch (32) is no wider than each
    # transformed layer's input + 1 (digits: 64 pixels, then 64 hidden units), and costs O(d^3) a step
    leaky = {"kind": "mlp", "hidden": [64, 64], "activation": "leaky_relu", "negative_slope": 0.1}
    presets["digits/symmetry"] = _digits(leaky, _teleport(0.2, 5.0, 32, method="symmetry"))
    notes["digits/symmetry"] = "demo: symmetry-teleport baseline on digits, LeakyReLU MLP [64, 64]"
    cnn = {"kind": "cnn", "channels": [16, 32], "kernel_size": 3, "pool": True}
    presets["digits/cnn"] = _digits(cnn, _teleport(3e-3, 40.0, 32), warmup_steps=40)
    notes["digits/cnn"] = "demo: null-space teleport of a CNN [16, 32] on digits, CNN-table teleport rates"
    return presets, notes


PRESETS: dict[str, dict[str, Any]]
PRESET_NOTES: dict[str, str]
PRESETS, PRESET_NOTES = _build()


def preset(name: str) -> dict[str, Any]:
    """A deep copy of one preset's raw spec (KeyError lists the names)."""
    if name not in PRESETS:
        raise KeyError(f"no preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return json.loads(json.dumps(PRESETS[name]))
