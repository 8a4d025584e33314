"""Step 2 for a teleport batch's blocks: every row class' basis, in this process or across data-parallel ranks.

In one process the representations R are decomposed batched by shape (``teleport.geometry.bases``), or one by one
through an executor (threads, Ray tasks). Across ranks the bases are those of the whole batch's R: the Gram matrices
R_r R_rᵀ are all-reduced when the batch has at least d columns, the columns are all-gathered otherwise; layer i's
decomposition is computed by rank i mod world (layer-parallel across ranks) and broadcast from there, so every rank
holds the same bases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from teleport.distributed import Collective
from teleport.executors import BasisExecutor, SerialExecutor
from teleport.geometry.bases import (
    Spectrum,
    compute_bases,
    compute_basis,
    gram,
    select_basis,
    spectrum_of_gram,
    svd_spectrum,
    working_dtype,
)
from teleport.geometry.blocks import Block, RowClass, build_blocks, fixed_widths, partition
from teleport.geometry.capture import UseRecorder
from teleport.geometry.certificate import Proofs
from teleport.geometry.eigh_route import EighRoutes


def layer_bases(blocks: list[Block] | UseRecorder, tau: float, executor: BasisExecutor,
                comm: Collective | None = None, rule: str = "numerical_rank",
                proofs: Proofs | None = None, routes: EighRoutes | None = None) -> list[Block]:
    """Partition each block's rows into classes and give every class its basis, through ``executor``.

    ``blocks`` may be a recorder that has seen the forward (``capture_inputs``): its blocks are built.
    One basis per distinct representation (Q/K/V reading one tensor share theirs); in this process
    (the serial executor, or any R on a GPU) they are decomposed batched by shape. With a collective,
    the bases are those of the whole batch across ranks, identical on every rank. ``proofs``: what the full-rank
    certificate made of the model's earlier batches (``certificate.Proofs``; batched in this process only); ``routes``:
    where the model's eigh runs (``eigh_route.EighRoutes``, measured once per shape).
    """
    if isinstance(blocks, UseRecorder):
        blocks = build_blocks(blocks.uses)[0]
    reps, slots = representations(blocks)
    if comm is not None and comm.world_size > 1:
        bases = [select_basis(spec, tau, rule) for spec in distributed_spectra(reps, comm, executor)]
    elif isinstance(executor, SerialExecutor) or any(r.device.type != "cpu" for r in reps):
        bases = compute_bases(reps, tau, rule, proofs, routes)  # batched by shape; on a GPU always (in turn)
    else:
        bases = executor.map(lambda r: compute_basis(r, tau, rule), reps)
    for cls, i in slots:
        cls.basis, cls.columns = bases[i], reps[i].shape[1]
    if comm is None or comm.world_size == 1:  # ranks keep their bases as they are: a shard's N is its own
        fixed_widths(blocks)
    return blocks


def representations(blocks: list[Block]) -> tuple[list[Tensor], list[tuple[RowClass, int]]]:
    """Partition each block's rows into classes: (every distinct R, each class with the index of its R)."""
    reps: list[Tensor] = []
    index: dict[tuple, int] = {}
    slots: list[tuple[RowClass, int]] = []
    for block in blocks:
        block.classes = partition(block)
        for cls in block.classes:
            key = cls.key(block.bias is not None, block.bias_id)
            if key not in index:
                index[key] = len(reps)
                reps.append(block.representation(cls))
            slots.append((cls, index[key]))
    return reps, slots


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
