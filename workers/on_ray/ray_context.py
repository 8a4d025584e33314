"""One rank of a Ray Train TorchTrainer as the training loop sees it (``workers.train.context.RunContext``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
from torch import nn

from teleport.distributed import Collective, TorchDistributed
from workers.train.context import RunContext, read_checkpoint, write_checkpoint
from workers.train.sinks import MetricSink


class RayTrainContext(RunContext):
    """One rank of a Ray Train TorchTrainer: DDP model, sharded loaders, ``ray.train.report``."""

    def __init__(self, sink: MetricSink, resume_from: Any = None, artifacts_dir: str | None = None) -> None:
        """``resume_from``: a checkpoint (``ray.train``/``ray.tune`` Checkpoint) to start from when this
        run has none of its own yet: a PBT trial continuing from another trial's weights. ``artifacts_dir``:
        the job's artifacts directory (on storage every node sees), created by rank 0."""
        ctx = ray.train.get_context()
        super().__init__(device=ray.train.torch.get_device(), sink=sink, rank=ctx.get_world_rank(),
                         world_size=ctx.get_world_size())
        self._comm = TorchDistributed() if self.world_size > 1 else None
        self._resume_from = resume_from
        if artifacts_dir is not None:
            self.artifacts_dir = Path(artifacts_dir)
            if self.is_chief:
                self.artifacts_dir.mkdir(parents=True, exist_ok=True)

    @property
    def comm(self) -> Collective | None:
        return self._comm

    def prepare_model(self, model: nn.Module) -> nn.Module:

        return ray.train.torch.prepare_model(model)  # [1] to the device, DDP-wrapped when world > 1

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:

        # [3] every rank reports (Ray Train needs all of them); rank 0 attaches the checkpoint
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if self.is_chief:
                write_checkpoint(state, Path(tmp))
                checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)

    def report_metrics(self, metrics: dict[str, Any]) -> None:

        ray.train.report(metrics)  # every rank, as in save

    def restore(self) -> dict[str, Any] | None:

        # the last one this run reported (after a worker restart), else the one it was told to start from
        checkpoint = ray.train.get_checkpoint() or self._resume_from
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as path:
            return read_checkpoint(Path(path))
