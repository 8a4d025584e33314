"""Which ascent takes a batch's steps: the one place that chooses (``choose``).

"host" — the host guard (``teleport.ascent.host``): Python decides on L and ‖∇L‖² read after every try; "device" —
the same rules as device ticks (``teleport.ascent.device``); "cuda_graph" — those ticks captured in a CUDA graph and
replayed for the model's later batches (``teleport.ascent.graphs``). All three take the same steps (tested against
``teleport.reference``); they differ in where the decisions run and what they cost.
"""

from __future__ import annotations

import torch

from teleport.ascent.graphs import DeviceTicks, GraphCache
from teleport.ascent.host import host_guard
from teleport.ascent.run import Ascent
from teleport.config import TeleportConfig
from teleport.distributed import Collective


def ascent_mode(config: TeleportConfig, device: torch.device, comm: Collective | None,
                cache: GraphCache | None = None) -> str:
    """How the steps run. "auto": on CUDA the CUDA graph (on an H200 8 forced steps of a GPT-style LM cost 9.3
    training steps against the host guard's 30.8, 3 launches a step, ``docs/results.md``), the host guard for a model
    whose tick a graph could not hold (faster than the eager ticks) or whose batches' shapes keep changing
    (``GraphCache.churning``: no graph would replay), and without CUDA (the fastest on the CPU); across ranks always
    the host guard (the ticks are single-process)."""
    if comm is not None and comm.world_size > 1:
        return "host"
    if config.ascent == "auto":
        graphs = cache is None or not (cache.capturing.failed or cache.churning)
        return "cuda_graph" if device.type == "cuda" and graphs else "host"
    return "device" if config.ascent == "cuda_graph" and device.type != "cuda" else config.ascent


def choose(mode: str, cache: GraphCache) -> Ascent:
    """The ascent of ``mode`` (``ascent_mode``), with the model's graph cache for the device ticks."""
    if mode == "host":
        return host_guard
    return DeviceTicks(cache, graphed=mode == "cuda_graph")
