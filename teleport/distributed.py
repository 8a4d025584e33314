"""Teleport across data-parallel ranks, so every replica ends with bit-identical weights.

Each rank holds a shard (x_r, y_r) of the teleport batch; the objective is the whole batch's:

    L = Σ_r w_r L_r,   w_r = n_r / N        ∇L = Σ_r w_r ∇L_r        (all-reduce the gradient)
    H·∇L = Σ_r w_r H_r·∇L                                             (all-reduce the HVPs)

where each rank's HVP is the backward of its own gradient graph against the *global* gradient.
The bases come from the whole batch's R (``teleport.geometry.layer_bases``), so every rank projects with the same
bases, takes the same decisions (CAP, back-off) from the same all-reduced numbers and ends with the same weights.

Only ``torch.distributed`` is used: Ray Train, torchrun or a hand-made process group all work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class Collective(Protocol):
    """The three collectives teleport needs. ``rank``/``world_size`` as in torch.distributed."""

    rank: int
    world_size: int

    def all_reduce_(self, t: Tensor) -> None: ...  # sum, in place

    def broadcast_(self, t: Tensor, src: int) -> None: ...

    def all_gather(self, t: Tensor) -> list[Tensor]: ...  # equal shapes on every rank


class TorchDistributed:
    """The default process group of ``torch.distributed`` (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce_(self, t: Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def broadcast_(self, t: Tensor, src: int) -> None:
        dist.broadcast(t, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)

    def all_gather(self, t: Tensor) -> list[Tensor]:
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out


def all_reduce_list_(comm: Collective, tensors: Sequence[Tensor]) -> None:
    """Sum a list of tensors across ranks with one collective (flatten, reduce, copy back)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce_(flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def any_across_(comm: Collective, masks: Sequence[Tensor]) -> None:
    """Logical OR of boolean masks across ranks, in place (rows an embedding reads on any rank)."""
    if not masks:
        return
    counts = [m.to(torch.float32) for m in masks]
    all_reduce_list_(comm, counts)
    for m, c in zip(masks, counts, strict=True):
        m.copy_(c > 0)
