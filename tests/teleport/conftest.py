"""``float64``: invariants are checked in float64 (``pytestmark = pytest.mark.usefixtures("float64")``).

``TLAB_TEST_DEVICE=cuda`` runs every teleport test on that device: tensors and models the tests make land
there (``torch.set_default_device``), so nothing in the library may assume a CPU.

``captures``: ``ascent: cuda_graph``'s capture path emulated on the CPU (``test_graph_cache.py`` says how).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from benchmarks.graph_emulation import emulated_graphs
from teleport.ascent.device import DeviceAscent

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


@pytest.fixture
def captures() -> Iterator[list[DeviceAscent]]:
    """``ascent: cuda_graph`` runs its capture path on the CPU (``benchmarks.graph_emulation``); yields the ascents
    whose full tick was captured. A test that patches the emulation further takes ``monkeypatch`` after this fixture,
    so its patches are undone first."""
    with emulated_graphs() as emulation:
        yield emulation.made
