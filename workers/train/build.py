"""The one place that turns spec sections into objects; nothing else reads the spec's nested fields.

Each builder takes one section (``spec.optimizer``, ``spec.teleport``, ``spec.training``) and
returns a plain object, so the training loop reads as flat calls.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from api_schemas.spec import ExperimentSpec, OptimizerSpec, ResourcesSpec, TeleportSpec, TrainingSpec
from teleport import BasisExecutor, TeleportConfig
from workers.train.sinks import MetricSink
from workers.train.startup import mark

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from workers.train.data_bundle import DataBundle

OPTIMIZER_NAMES = ("sgd", "momentum", "adagrad", "adam", "adamw")


def build_optimizer(spec: OptimizerSpec, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """``optimizer`` section -> a torch optimizer; ``momentum`` is SGD with ``spec.momentum``."""
    params = list(params)
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay)
    if spec.name == "momentum":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if spec.name == "adagrad":
        return torch.optim.Adagrad(params, lr=spec.lr, weight_decay=spec.weight_decay)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
    if spec.name == "adamw":
        return torch.optim.AdamW(decay_groups(params, spec), lr=spec.lr, betas=spec.betas,
                                 weight_decay=spec.weight_decay)
    raise ValueError(f"optimizer.name={spec.name!r}: use one of {', '.join(OPTIMIZER_NAMES)}")


def decay_groups(params: list[nn.Parameter], spec: OptimizerSpec) -> list[dict[str, Any]]:
    """AdamW's parameter groups: matrices and embeddings (2-D and up) decay, biases and normalization weights (1-D)
    do not, as nanoGPT's ``configure_optimizers`` and Hugging Face's Trainer do; ``optimizer.decay_all``: one group
    where every parameter decays."""
    if spec.decay_all:
        return [{"params": params}]
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def lr_factor(spec: OptimizerSpec, step: int, total: int) -> float:
    """The learning rate of optimizer step ``step`` (0, 1, ...) of a run of ``total`` as a share of ``optimizer.lr``:
    ``(step + 1) / (n + 1)`` in the first ``n = lr_warmup_steps``, then constant, or a half cosine or a line from 1
    to ``final_lr_ratio`` at the last step (and held there past it).

    >>> spec = OptimizerSpec(schedule="cosine", lr_warmup_steps=1, final_lr_ratio=0.1)
    >>> [round(lr_factor(spec, s, 4), 3) for s in range(5)]
    [0.5, 1.0, 0.55, 0.1, 0.1]
    """
    warmup = spec.lr_warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if spec.schedule == "constant":
        return 1.0
    done = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    left = 0.5 * (1 + math.cos(math.pi * done)) if spec.schedule == "cosine" else 1 - done
    return spec.final_lr_ratio + (1 - spec.final_lr_ratio) * left


def build_lr_schedule(spec: OptimizerSpec, optimizer: torch.optim.Optimizer, total: int,
                      done: int) -> torch.optim.lr_scheduler.LambdaLR | None:
    """``optimizer.schedule`` and ``lr_warmup_steps`` -> the scheduler to step after each optimizer step of a run of
    ``total`` steps, ``done`` of them already taken (a resumed run); None for a constant lr. Its base is the spec's
    ``optimizer.lr``, not a checkpoint's (a PBT trial goes on with its mutated lr), and the optimizer's lr is set to
    step ``done``'s at once."""
    if spec.schedule == "constant" and not spec.lr_warmup_steps:
        return None
    for group in optimizer.param_groups:
        group["initial_lr"] = spec.lr  # what LambdaLR scales; a resumed optimizer's groups hold the checkpoint's
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, spec, total=total),
                                             last_epoch=done - 1)


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Forget momentum buffers / Adam moments / Adagrad sums (``teleport.reset_optimizer``).

    After a teleport the weights sit somewhere else on the level set, so the accumulated
    statistics describe a point the model has left. Adam's step count restarts too.
    """
    optimizer.state.clear()


def build_parts(spec: ExperimentSpec, sink: MetricSink, seed: int
                ) -> tuple[DataBundle, nn.Module, Callable[[Tensor, Tensor], Tensor]]:
    """The data, the model and the loss of ``spec`` (built-in or the user's factories). A failure inside the
    user's code is raised as one line (``workers.train.user_code.UserCodeError``) after its full traceback went to
    ``sink`` as a ``log`` event. The loss checks the model's output on its first call (``workers.train.model_output``:
    a tuple, a scalar or a misshapen output is one line naming the fix)."""
    from workers.train.custom_data import check_targets
    from workers.train.datasets import load_dataset
    from workers.train.model_output import CheckedLoss
    from workers.train.models import build_model_for, loss_fn_for
    from workers.train.user_code import UserCodeError, report

    try:
        data = load_dataset(spec.dataset, seed=seed)
        check_targets(spec.training.loss, data)
        mark("data")  # the start-up timeline of a job's driver (``workers.train.startup``)
        model = build_model_for(spec.model, data)
        mark("model")
        loss_fn = loss_fn_for(data.task, spec.training.loss)
        own_loss = spec.training.loss and ":" in spec.training.loss  # the user's loss takes what their model gives
        return data, model, loss_fn if own_loss else CheckedLoss(loss_fn, data.task)
    except UserCodeError as err:
        report(sink, err)
        raise


def teleport_config(spec: TeleportSpec) -> TeleportConfig:
    """``teleport`` section -> the algorithm's hyperparameters (paper symbols: t, η, CAP, τ)."""
    cap = math.inf if spec.cap is None else spec.cap  # none: each batch's own (cap_ratio) alone
    return TeleportConfig(steps=spec.steps, lr=spec.lr, cap=cap, tau=spec.tau, loss_tol=spec.loss_tol,
                          max_backoff=spec.max_backoff, tau_rule=spec.tau_rule, ascent=spec.ascent, hvp=spec.hvp,
                          rise=spec.rise, cap_ratio=spec.cap_ratio)


def basis_executor(spec: TeleportSpec) -> BasisExecutor:
    """``teleport.parallel`` -> where per-layer bases are computed (serial, threads, Ray tasks, auto)."""
    from workers.train.executors import make_executor

    return make_executor(spec.parallel)


def select_device(spec: TrainingSpec) -> torch.device:
    """``training.device``: ``auto`` is CUDA when one is visible, else CPU."""
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device=cuda, but no CUDA device is visible: set training.device=auto")
    if spec.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec.device)


def select_dtype(spec: TrainingSpec) -> torch.dtype:
    """``training.dtype``: the dtype of the weights and of floating-point inputs and targets."""
    return {"float32": torch.float32, "float64": torch.float64}[spec.dtype]


def autocast(spec: TrainingSpec, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """``training.precision``: ``torch.autocast`` to bfloat16 (bf16) or float16 (fp16) on ``device``'s type (CPU and
    CUDA alike), a context that does nothing for fp32. Wrap the forward and the loss only, never the backward or a
    teleport."""
    if spec.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if spec.precision == "bf16" else torch.float16)


def grad_scaler(spec: TrainingSpec, device: torch.device) -> torch.amp.GradScaler | None:
    """``training.precision: fp16``: the scaler of the loss (float16's range would flush small gradients to 0);
    None otherwise (bf16 has float32's range)."""
    return torch.amp.GradScaler(device.type) if spec.precision == "fp16" else None


def num_threads(spec: ResourcesSpec) -> int:
    """Torch (BLAS/OpenMP) threads for one worker: ``resources.cpus_per_worker``, at least 1.

    Threads beyond the cores a run owns spin against other processes. Measured on the 2-core dev
    box with another process busy: a digits teleport run took 1 s with one thread, 110 s with two.
    Ray gives its workers ``OMP_NUM_THREADS = num_cpus``; local runs follow the same field.
    """
    return max(1, min(int(spec.cpus_per_worker), os.cpu_count() or 1))


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices): same seed -> same init, batches and teleports."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
