"""``float64``: invariants are checked in float64 (``pytestmark = pytest.mark.usefixtures("float64")``).

``TLAB_TEST_DEVICE=cuda`` runs every teleport test on that device: tensors and models the tests make land
there (``torch.set_default_device``), so nothing in the library may assume a CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

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
