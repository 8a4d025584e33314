"""The package walls of DESIGN.md, checked in a clean interpreter by looking at sys.modules."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import import_graph

# package -> top-level modules it must never pull in (directly or through what it imports)
FORBIDDEN = {
    "teleport": ["ray", "redis", "fastapi", "pydantic", "api_schemas", "workers", "service", "matplotlib"],
    "api_schemas": ["torch", "ray", "redis", "fastapi", "teleport", "workers", "service"],
    "workers": ["fastapi", "service"],
    "service": ["torch", "teleport", "workers"],
    # the bucket layer both workers/ and service/ use: pyarrow and the standard library only
    "objstore": ["torch", "ray", "redis", "fastapi", "pydantic", "teleport", "api_schemas", "workers", "service"],
    "plots.curves": ["torch", "ray", "redis", "fastapi", "teleport", "workers", "service", "api_schemas"],
    # the notebook client (docs/client.md): HTTP, pandas and the spec files only
    "tlab": ["torch", "ray", "redis", "fastapi", "teleport", "workers", "service", "matplotlib", "pandas"],
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
ROUTE_MODULES = [f"service.api.routes.{m.name}"
                 for m in pkgutil.iter_modules([str(ROOT / "service" / "api" / "routes")])]


@pytest.mark.parametrize("module", ["service.cli", "service.api.app", "service.scheduler.tick", "service.stack.up",
                                    "service.cli.demo", *ROUTE_MODULES])
def test_service_modules_stay_inside_their_wall(module: str) -> None:
    assert ROUTE_MODULES
    loaded = loaded_top_level(module)
    assert not {"torch", "teleport", "workers"} & loaded


# ---- inside service/ and workers/: packages named after where their code runs (README.md, Package map)

# service/: the four processes' packages never import one another; below them each imports only what is below it
SERVICE_TOP = ("cli", "stack", "api", "scheduler")
SERVICE_BELOW = ("launch", "rules", "core")  # in this order: launch may import rules and core, rules only core
SERVICE_EXCEPTIONS = {
    ("cli", "stack"): "`tlab up` and `tlab demo` run the embedded stack in the CLI's own process",
}
# workers/: entry points (python -m targets, at the top) -> on_ray -> job -> train
WORKERS_ORDER = ("", "on_ray", "job", "train")
# train/ never imports Ray or Redis, but for these (module: why)
TRAIN_REACHES_RAY = {
    "workers.train.executors": "teleport.parallel ray/auto sends the per-layer bases to Ray tasks (imported in the "
                               "executor, only when a Ray cluster is up)",
}


def _package(module: str) -> str:
    """``service.api.routes.users`` -> ``api``; a module at the top of its package (``workers.run``) -> ``""``."""
    parts = module.split(".")
    subpackages = (ROOT / parts[0] / parts[1]).is_dir() if len(parts) > 1 else False
    return parts[1] if subpackages else ""


# the one circle on purpose: a gang rank's Ray task (``gang_start.gang_rank``, torch-free for the driver that starts
# the ranks) imports the supervisor only when it runs, on the rank's node; the supervisor starts ``Ranks`` itself
DECLARED_CIRCLES = [["workers.on_ray.gang_start", "workers.on_ray.supervisor"]]


def test_no_module_imports_in_a_circle() -> None:
    found = [group for pkg in ("service", "workers", "api_schemas")
             for group in import_graph.circles(import_graph.graph(pkg))]
    assert sorted(found) == DECLARED_CIRCLES, f"import circles: {found}"


def test_service_packages_import_only_downwards() -> None:
    bad = []
    for module, targets in import_graph.graph("service").items():
        here = _package(module)
        for target in targets:
            there = _package(target)
            if there in ("", here) or (here, there) in SERVICE_EXCEPTIONS:
                continue
            below = here in SERVICE_BELOW and SERVICE_BELOW.index(there) < SERVICE_BELOW.index(here)
            if there in SERVICE_TOP or below:
                bad.append(f"{module} -> {target}")
    assert not bad, f"service/ imports against its layers (name an exception with its reason): {bad}"


def test_workers_packages_import_only_downwards() -> None:
    bad = [f"{module} -> {target}" for module, targets in import_graph.graph("workers").items() for target in targets
           if module != "workers" and (WORKERS_ORDER.index(_package(target)) < WORKERS_ORDER.index(_package(module))
                                       or _package(target) == "" and target != "workers")]
    assert not bad, f"workers/ imports against entry points -> on_ray -> job -> train: {bad}"


def test_train_never_imports_ray_or_redis() -> None:
    bad = {module: sorted(reached) for module, path in import_graph.modules("workers.train").items()
           if (reached := import_graph.top_level_imports(path) & {"ray", "redis"}) and module not in TRAIN_REACHES_RAY}
    assert not bad, f"workers/train/ must run without Ray or Redis: {bad}"
