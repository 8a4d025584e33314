"""``teleport.ascent: cuda_graph``'s capture path run on the CPU: what a replayed batch launches, counted without a GPU.

A CUDA graph replays its kernels on the tensors it was captured with. Here the "graph" of a tick is the captured
``DeviceAscent``'s own tick called again on the same objects (``Replay``): it reads the same static inputs, state
tensors, blocks and bases a replay reads, so the teleport takes the steps a captured one takes, and a kernel count
can tell the eager setup from the ticks a GPU would replay from its graphs. What only CUDA shows (the capture
itself, a graph's memory pool, the GPU's time per kernel) is left to ``benchmarks/gpu_checks.sh``. The teleport
tests emulate the capture the same way (``tests/teleport/conftest.py``'s ``captures``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from teleport import teleporter
from teleport.ascent.device import Capturing, DeviceAscent


@dataclass
class Emulation:
    """The ascents whose full tick was "captured", and what the emulated graphs replayed."""

    made: list[DeviceAscent] = field(default_factory=list)
    replaying: bool = False  # a replay is running: its kernels are the graph's
    replays: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # full? -> ticks replayed


class Replay:
    """The emulated graph of a tick: the captured ascent's tick (``full``, or the judging one), on its own objects."""

    def __init__(self, ascent: DeviceAscent, full: bool, emulation: Emulation) -> None:
        self.ascent, self.full, self.emulation, self.replays = ascent, full, emulation, 0

    def replay(self) -> None:
        self.replays += 1
        self.emulation.replays[self.full] += 1
        self.emulation.replaying = True
        try:
            self.ascent.tick(self.full)
        finally:
            self.emulation.replaying = False


@contextlib.contextmanager
def emulated_graphs() -> Iterator[Emulation]:
    """Inside, a teleport of ``ascent: cuda_graph`` runs the capture path on the CPU (see the module); the patched
    attributes are put back after, even when the block raises."""
    emulation = Emulation()
    mode = teleporter.ascent_mode

    def capture(self: DeviceAscent, side: Any, full: bool = True) -> Replay:
        if full:
            emulation.made.append(self)
        self.mode = "cuda_graph"
        return Replay(self, full, emulation)

    def graph_on_cpu(config: Any, device: Any, comm: Any, cache: Any = None) -> str:
        return "cuda_graph" if config.ascent == "cuda_graph" else mode(config, device, comm, cache)

    patches = [(teleporter, "ascent_mode", graph_on_cpu),
               (Capturing, "own_stream", lambda self, device, enabled: contextlib.nullcontext()),
               (Capturing, "side_stream", lambda self, device: "side"),
               (DeviceAscent, "_on", staticmethod(lambda side, fn: fn())), (DeviceAscent, "_capture", capture)]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield emulation
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
