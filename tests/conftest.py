"""Shared fixtures: a real local Ray cluster for the tests that need one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_local() -> Iterator[object]:
    """A real single-node Ray cluster (2 CPUs), started once per test session in a temp dir."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # throwaway test cluster on loopback
    temp = tempfile.mkdtemp(prefix="tlray", dir="/tmp")  # short: Ray's socket paths are length-limited
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
