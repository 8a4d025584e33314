"""Teleport across data-parallel ranks, so every replica ends with bit-identical weights.

Each rank holds a shard (x_r, y_r) of the teleport batch; the objective is the whole batch's:

    L = Σ_r w_r L_r,   w_r = n_r / N        ∇L = Σ_r w_r ∇L_r        (all-reduce the gradient)
    H·∇L = Σ_r w_r H_r·∇L                                             (all-reduce the HVPs)

where each rank's HVP is the backward of its own gradient graph against the *global* gradient.
The bases come from the whole batch's R: the Gram matrices R_r R_rᵀ are all-reduced when the
batch has at least d columns, the columns are all-gathered otherwise. Layer i's decomposition
is computed by rank i mod world (layer-parallel across ranks) and broadcast from there, so every
rank projects with the same bases, takes the same decisions (CAP, back-off) from the same
all-reduced numbers and ends with the same weights.

Only ``torch.distributed`` is used: Ray Train, torchrun or a hand-made process group all work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from teleport.bases import Spectrum, gram, spectrum_of_gram, svd_spectrum, working_dtype
from teleport.executors import BasisExecutor


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


def _gather_columns(comm: Collective, rep: Tensor) -> Tensor:
    """[R_0 | R_1 | ...] (d, N) from shards with possibly different column counts."""
    counts = torch.tensor([rep.shape[1]], device=rep.device)
    sizes = [int(c) for c in comm.all_gather(counts)]
    padded = rep.new_zeros(rep.shape[0], max(sizes))
    padded[:, : rep.shape[1]] = rep
    return torch.cat([p[:, :n] for p, n in zip(comm.all_gather(padded), sizes, strict=True)], dim=1)


@dataclass(frozen=True)
class Decomposition:
    """One layer's whole-batch decomposition to compute: its Gram (d, d) in float64, or R (d, N)."""

    matrix: Tensor
    cols: int
    gram: bool
    dtype: torch.dtype  # R's dtype: the vectors come back in it (float32 at least)

    @property
    def shape(self) -> tuple[int, int]:  # what executors size the work by
        return (self.matrix.shape[0], self.cols)

    @property
    def device(self) -> torch.device:
        return self.matrix.device

    def run(self) -> Spectrum:
        if self.gram:
            return spectrum_of_gram(self.matrix, self.cols, self.dtype)
        return svd_spectrum(self.matrix)  # vectors (d, N) in R's dtype: what the other ranks expect


def distributed_spectra(reps: Sequence[Tensor], comm: Collective, executor: BasisExecutor) -> list[Spectrum]:
    """The whole batch's spectrum of every R, computed layer-parallel across ranks, identical on all."""
    device = reps[0].device if reps else torch.device("cpu")
    cols = torch.tensor([r.shape[1] for r in reps], device=device, dtype=torch.long)
    comm.all_reduce_(cols)
    jobs: list[Decomposition] = []  # per layer: the full Gram (float64) or the full column set
    for rep, n in zip(reps, cols.tolist(), strict=True):
        if n >= rep.shape[0]:
            g = gram(rep)
            comm.all_reduce_(g)
            jobs.append(Decomposition(g, n, True, rep.dtype))
        else:
            jobs.append(Decomposition(_gather_columns(comm, rep), n, False, rep.dtype))
    mine = [i for i in range(len(reps)) if i % comm.world_size == comm.rank]
    computed = dict(zip(mine, executor.map(Decomposition.run, [jobs[i] for i in mine]), strict=True))
    out = []
    for i, rep in enumerate(reps):
        d, n = rep.shape[0], int(cols[i])
        route = "gram" if n >= d else "svd"
        m = d if route == "gram" else n
        owner = i % comm.world_size
        if owner == comm.rank:
            spec = computed[i]
            sq, vectors = spec.sq.contiguous(), spec.vectors.contiguous()
        else:
            sq = torch.empty(m, dtype=torch.float64, device=rep.device)
            vectors = torch.empty(d, m, dtype=working_dtype(rep.dtype), device=rep.device)
        comm.broadcast_(sq, owner)
        comm.broadcast_(vectors, owner)
        out.append(Spectrum(sq, vectors, n, route, rep.dtype))
    return out
