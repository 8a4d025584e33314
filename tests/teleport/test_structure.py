"""``teleport/`` as one object a maintainer can read: no mutable state at module level (a ``Teleporter`` holds it all),
at most 14 rooms at its top and 7 import floors (sub-packages counted as one room each), and no circle."""

from __future__ import annotations
import __future__

import importlib
import pkgutil
import types
from dataclasses import is_dataclass
from functools import cache
from typing import Any

import torch

import teleport
from tests.import_graph import circles, graph

# values a module may hold at its top: what nothing can change in place
IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), tuple, frozenset, range, type, types.ModuleType,
             types.FunctionType, types.BuiltinFunctionType, types.MappingProxyType, types.UnionType, torch.dtype,
             torch.device, __future__._Feature)


def _modules() -> list[types.ModuleType]:
    names = [m.name for m in pkgutil.walk_packages(teleport.__path__, "teleport.")]
    return [teleport, *(importlib.import_module(n) for n in names)]


def _frozen(value: Any) -> bool:
    params = getattr(type(value), "__dataclass_params__", None)
    return is_dataclass(value) and not isinstance(value, type) and params is not None and params.frozen


def _mutable(value: Any) -> bool:
    if isinstance(value, IMMUTABLE) or _frozen(value) or callable(value):
        return False
    return not type(value).__module__.startswith("typing")  # aliases (Callable[...], unions) are types, not state


def test_no_module_of_teleport_holds_mutable_state() -> None:
    found = []
    for module in _modules():
        for name, value in vars(module).items():
            if name.startswith("__") and name != "__all__":
                continue
            if _mutable(value):
                found.append(f"{module.__name__}.{name}: {type(value).__name__}")
    assert found == [], f"module-level state (put it on the Teleporter, or make it a tuple/frozenset): {found}"


def test_the_check_finds_state_where_there_is_some(monkeypatch: Any) -> None:
    monkeypatch.setattr(teleport.teleporter, "_SEEN", {}, raising=False)
    assert any(_mutable(v) for v in vars(teleport.teleporter).values())


@cache
def _rooms() -> dict[str, set[str]]:
    """Top-level room of ``teleport`` (a module, or a sub-package as one) -> the rooms it imports."""
    def room(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2])

    edges: dict[str, set[str]] = {}
    for module, targets in graph("teleport").items():
        if module == "teleport":  # the package's face hands names on
            continue
        edges.setdefault(room(module), set()).update(room(t) for t in targets if t != "teleport")
    return {r: targets - {r} for r, targets in edges.items()}


def _floor(room: str, edges: dict[str, set[str]]) -> int:
    return 1 + max((_floor(t, edges) for t in edges[room]), default=0)


def test_teleport_has_at_most_14_rooms_on_7_floors_and_no_circle() -> None:
    edges = _rooms()
    assert len(edges) <= 14, sorted(edges)
    assert circles(edges) == []
    floors = {r: _floor(r, edges) for r in edges}
    assert max(floors.values()) <= 7, floors
    assert circles(graph("teleport")) == []  # inside the sub-packages too


def test_the_reference_stands_apart_from_the_speed_paths() -> None:
    """The oracle takes the geometry and the step rules the fast paths take, never their speed paths."""
    imported = graph("teleport")["teleport.reference"]
    assert not {m for m in imported if m.startswith(("teleport.ascent.device", "teleport.ascent.graphs",
                                                     "teleport.ascent.host", "teleport.hvp.spanfree",
                                                     "teleport.hvp.factored", "teleport.teleporter"))}
