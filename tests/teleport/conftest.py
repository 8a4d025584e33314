"""``float64``: invariants are checked in float64 (``pytestmark = pytest.mark.usefixtures("float64")``).

``TLAB_TEST_DEVICE=cuda`` runs every teleport test on that device: tensors and models the tests make land
there (``torch.set_default_device``), so nothing in the library may assume a CPU.

``captures``: ``ascent: cuda_graph``'s capture path emulated on the CPU (``test_graph_cache.py`` says how).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from teleport import ascent, nullspace
from teleport.ascent import ascent_mode
from teleport.on_device import DeviceAscent

DEVICE = os.environ.get("TLAB_TEST_DEVICE", "")


@pytest.fixture
def float64() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(autouse=True)
def test_device() -> Iterator[None]:
    if not DEVICE:
        yield
        return
    torch.set_default_device(DEVICE)
    try:
        yield
    finally:
        torch.set_default_device(None)


class _Replay:
    """The emulated graph of a full tick: the captured ascent's tick, on its own objects."""

    def __init__(self, ascent: DeviceAscent, full: bool = True) -> None:
        self.ascent, self.full, self.replays = ascent, full, 0

    def replay(self) -> None:
        self.replays += 1
        self.ascent.tick(self.full)


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[DeviceAscent]]:
    """``ascent: cuda_graph`` runs its capture path on the CPU; yields the ascents whose full tick was captured."""
    made: list[DeviceAscent] = []
    mode = ascent_mode

    def capture(self: DeviceAscent, side: Any, full: bool = True) -> _Replay:
        if full:
            made.append(self)
        self.mode = "cuda_graph"
        return _Replay(self, full)

    def graph_on_cpu(c: Any, d: Any, comm: Any, model: Any = None) -> str:
        return "cuda_graph" if c.ascent == "cuda_graph" else mode(c, d, comm, model)

    for where in (nullspace, ascent):  # teleport_batch's choice and the ascent's
        monkeypatch.setattr(where, "ascent_mode", graph_on_cpu)
    monkeypatch.setattr(nullspace, "own_stream", lambda device, enabled: contextlib.nullcontext())
    monkeypatch.setattr("teleport.on_device._side_stream", lambda device: "side")
    monkeypatch.setattr(DeviceAscent, "_on", staticmethod(lambda side, fn: fn()))
    monkeypatch.setattr(DeviceAscent, "_capture", capture)
    yield made
