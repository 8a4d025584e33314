"""Fixtures of the ``tlab up`` tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def passable_home() -> Iterator[Path]:
    """A TLAB_HOME for a real ``tlab up``, in a directory of its own under /tmp: as root, ``tlab up`` runs its Ray head
    as the service user, which must pass every directory above its storage (pytest's temp root is 0700, as /root is:
    refused at start)."""
    path = Path(tempfile.mkdtemp(prefix="tlab-home-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def up_home() -> Iterator[Path]:
    with passable_home() as path:
        yield path
