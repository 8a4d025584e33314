"""Where a training loop runs: in this process, or as one rank of a Ray Train DDP worker group.

The loop (``workers.local.train``) is written once against ``RunContext``; the context decides the
device, how the model is wrapped for DDP, how data is sharded, how ranks reduce numbers, where
checkpoints go and which rank writes metrics.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from teleport.distributed import Collective, TorchDistributed
from workers.sinks import MetricSink, NullSink


@dataclass
class RunContext:
    """In-process defaults: one rank, no DDP, no checkpoints."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sink: MetricSink = field(default_factory=NullSink)
    rank: int = 0
    world_size: int = 1

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
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=g)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return values

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        """Keep the state to resume from after a failure; an in-process run has no one to resume it."""

    def restore(self) -> dict[str, Any] | None:
        return None


class RayTrainContext(RunContext):
    """One rank of a Ray Train TorchTrainer: DDP model, sharded loaders, ``ray.train.report``."""

    def __init__(self, sink: MetricSink, resume_from: Any = None) -> None:
        """``resume_from``: a checkpoint (``ray.train``/``ray.tune`` Checkpoint) to start from when this
        run has none of its own yet: a PBT trial continuing from another trial's weights."""
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        super().__init__(device=ray.train.torch.get_device(), sink=sink, rank=ctx.get_world_rank(),
                         world_size=ctx.get_world_size())
        self._comm = TorchDistributed() if self.world_size > 1 else None
        self._resume_from = resume_from

    @property
    def comm(self) -> Collective | None:
        return self._comm

    def prepare_model(self, model: nn.Module) -> nn.Module:
        import ray.train.torch

        return ray.train.torch.prepare_model(model)  # [1] to the device, DDP-wrapped when world > 1

    def loader(self, dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int, epoch: int) -> DataLoader:
        if self.world_size == 1:
            return super().loader(dataset, batch_size, shuffle=shuffle, seed=seed, epoch=epoch)
        # [2] each rank reads its own shard; set_epoch reshuffles identically on every rank
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle,
                                     seed=seed, drop_last=False)
        sampler.set_epoch(epoch)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        import ray.train

        # [3] every rank reports (Ray Train needs all of them); rank 0 attaches the checkpoint
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if self.is_chief:
                torch.save(state, Path(tmp) / "checkpoint.pt")
                # the epoch to go on from, readable without loading the weights (a PBT trial's driver)
                (Path(tmp) / "meta.json").write_text(json.dumps({"epoch": state.get("epoch")}))
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)

    def restore(self) -> dict[str, Any] | None:
        import ray.train

        # the last one this run reported (after a worker restart), else the one it was told to start from
        checkpoint = ray.train.get_checkpoint() or self._resume_from
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as path:
            return torch.load(Path(path) / "checkpoint.pt", map_location="cpu", weights_only=False)
