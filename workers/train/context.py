"""Where a training loop runs: in this process (one rank of a gang included); one rank of a Ray Train DDP worker
group is ``workers.on_ray.ray_context``.

The loop (``workers.train.loop.train``) is written once against ``RunContext``; the context decides the
device, how the model is wrapped for DDP, how data is sharded, how ranks reduce numbers, where
checkpoints go and which rank writes metrics.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from teleport.distributed import Collective
from workers.train.sinks import MetricSink, NullSink

CHECKPOINT_FILE = "checkpoint.pt"


def keep_checkpoints() -> int:
    """``TLAB_KEEP_CHECKPOINTS``: how many of a run's latest checkpoints are kept (at least 1), by Ray Train
    and by a job training in its driver alike."""
    raw = os.environ.get("TLAB_KEEP_CHECKPOINTS", "2")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TLAB_KEEP_CHECKPOINTS={raw!r}: give a whole number of at least 1")
    return int(raw)


def checkpoint_every_s() -> float:
    """``TLAB_CHECKPOINT_EVERY_S``: a job training in its driver writes an epoch's checkpoint only when this many
    seconds have passed since its last write (default 2; 0: every epoch). The last ``TLAB_KEEP_CHECKPOINTS``
    epochs' states, held in memory meanwhile, are written whenever the run ends, is stopped (cancel, time limit,
    preemption) or fails; only a kill (SIGKILL, a lost node) loses the epochs of the last interval, which the
    retry runs again (``workers.on_ray.driver.DriverContext.save``)."""
    raw = os.environ.get("TLAB_CHECKPOINT_EVERY_S", "2")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"TLAB_CHECKPOINT_EVERY_S={raw!r}: give a number of seconds, 0 or more")
    return value


class CheckpointRefused(RuntimeError):
    """A checkpoint holds something other than tensors and plain values: it is not loaded."""


def plain(value: Any) -> Any:
    """``value`` as what ``torch.load(weights_only=True)`` reads back: numpy scalars become numbers and
    numpy arrays tensors, inside dicts, lists and tuples; a container with nothing to change is returned
    as it is (a state_dict keeps its ``_metadata``)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        items = {k: plain(v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else type(value)(items)
    if isinstance(value, list | tuple):
        seq = [plain(v) for v in value]
        return value if all(a is b for a, b in zip(seq, value, strict=True)) else type(value)(seq)
    return value


def detached_copy(value: Any) -> Any:
    """``value`` with every tensor copied to host memory: what a checkpoint written in the background holds
    while the loop goes on changing the weights in place (numpy arrays copied too). Dicts keep their kind and a
    state_dict its ``_metadata``; lists and tuples are copied; anything else is shared (numbers, strings)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, np.ndarray):  # an own loop's checkpoint may hold arrays (``plain`` turns them to tensors)
        return value.copy()
    if isinstance(value, dict):
        items = ((k, detached_copy(v)) for k, v in value.items())
        out = OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, list):
        return [detached_copy(v) for v in value]
    if type(value) is tuple:
        return tuple(detached_copy(v) for v in value)
    return value


def write_checkpoint(state: dict[str, Any], directory: Path, attempt: int | None = None) -> None:
    """``DIR/checkpoint.pt`` (plain types and tensors only) and ``DIR/meta.json`` (the epoch to go on from,
    readable without loading the weights: a PBT trial's driver; the job's attempt that wrote it, when known)."""
    torch.save(plain(state), directory / CHECKPOINT_FILE)
    meta = {"epoch": state.get("epoch"), **({"attempt": attempt} if attempt is not None else {})}
    (directory / "meta.json").write_text(json.dumps(meta))


def read_checkpoint(directory: Path) -> dict[str, Any]:
    """What ``write_checkpoint`` wrote, loaded with ``weights_only=True``: a checkpoint is data, never code."""
    path = directory / CHECKPOINT_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = found.group(1) if found else "an object that is not a tensor or a plain value"
        raise CheckpointRefused(f"checkpoint {path}: refused: it references {what}, and a checkpoint holds only "
                                f"tensors and plain values; nothing in it was run") from None


@dataclass
class RunContext:
    """In-process defaults: one rank, no DDP, no checkpoints."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sink: MetricSink = field(default_factory=NullSink)
    rank: int = 0
    world_size: int = 1
    artifacts_dir: Path | None = None  # files written here (by rank 0) are the job's artifacts; None: not kept

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def comm(self) -> Collective | None:
        return None

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The module the optimizer steps through (DDP-wrapped on Ray); teleport uses the bare one."""
        return model.to(self.device)

    def loader(self, dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, epoch: int) -> DataLoader:
        pin = self.device.type == "cuda"  # a pinned batch's copy to the GPU does not make the host wait
        if self.world_size == 1:
            g = torch.Generator().manual_seed(seed * 100_003 + epoch)
            return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=g, pin_memory=pin)
        # each rank reads its own shard; set_epoch reshuffles identically on every rank
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle,
                                     seed=seed, drop_last=False)
        sampler.set_epoch(epoch)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, pin_memory=pin)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum over the ranks (of the default process group when there are several)."""
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        """Keep the state to resume from after a failure; an in-process run has no one to resume it."""

    def flush(self) -> None:
        """Return once every checkpoint saved so far is written (a context that writes them in the background:
        ``workers.on_ray.driver.DriverContext``); the loop calls it before it returns or raises."""

    def report_metrics(self, metrics: dict[str, Any]) -> None:
        """Metrics without a checkpoint (an own loop's epoch it did not checkpoint: ``workers.train.own_loop``); every
        rank calls it, as ``save``. In-process there is no one to tell."""

    def restore(self) -> dict[str, Any] | None:
        return None


