"""The package walls of DESIGN.md, checked in a clean interpreter by looking at sys.modules."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

# package -> top-level modules it must never pull in (directly or through what it imports)
FORBIDDEN = {
    "teleport": ["ray", "redis", "fastapi", "pydantic", "api_schemas", "workers", "service", "matplotlib"],
    "api_schemas": ["torch", "ray", "redis", "fastapi", "teleport", "workers", "service"],
    "workers": ["fastapi", "service"],
    "service": ["torch", "teleport", "workers"],
    # the bucket layer both workers/ and service/ use: pyarrow and the standard library only
    "objstore": ["torch", "ray", "redis", "fastapi", "pydantic", "teleport", "api_schemas", "workers", "service"],
    "plots.curves": ["torch", "ray", "redis", "fastapi", "teleport", "workers", "service", "api_schemas"],
    "plots.tables": ["torch", "ray", "redis", "fastapi", "teleport", "workers", "service", "api_schemas", "matplotlib"],
}


def loaded_top_level(module: str) -> set[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_inside_their_walls(package: str) -> None:
    loaded = loaded_top_level(package)
    assert package.split(".")[0] in loaded
    leaked = sorted(set(FORBIDDEN[package]) & loaded)
    assert not leaked, f"{package} imports {leaked}, which DESIGN.md's walls forbid"


ROOT = Path(__file__).resolve().parents[1]
# every router file is checked on its own, found by name (a new service/api/routes/*.py is covered without a list)
ROUTE_MODULES = [f"service.api.routes.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "service" / "routes")])]


@pytest.mark.parametrize("module", ["service.cli", "service.api.app", "service.scheduler.tick",
"service.stack.embedded",
                                    "service.cli.demo", *ROUTE_MODULES])
def test_service_modules_stay_inside_their_wall(module: str) -> None:
    loaded = loaded_top_level(module)
    assert not {"torch", "teleport", "workers"} & loaded
