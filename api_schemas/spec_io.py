"""Reading specs: YAML/JSON files, presets, and ``--set a.b=c`` overrides on any field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from api_schemas.spec import DATASET_TAGS, ExperimentSpec

UNION_TAGS = frozenset({"mlp", "cnn", "resnet", "transformer", "custom", *DATASET_TAGS})  # not fields: which kind

class SpecError(ValueError):
    """A spec that cannot be used; the message names the field path and what to change."""


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: ``teleport.tau: Input should be less than or equal to 1``."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"] if not (isinstance(p, str) and p in UNION_TAGS))
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {msg}" if path else msg)
    return "\n".join(lines)


def parse_value(text: str) -> Any:
    """``--set`` values are YAML scalars/lists: ``0.99`` -> float, ``[1,2]`` -> list, ``adam`` -> str."""
    return yaml.safe_load(text)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.path=value`` overrides to a nested dict (a copy is returned)."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise SpecError(f"override {item!r}: write it as path=value, e.g. teleport.tau=0.99")
        path, _, raw = item.partition("=")
        keys = [k for k in path.strip().split(".") if k]
        if not keys:
            raise SpecError(f"override {item!r}: the path before '=' is empty")
        node = out
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise SpecError(f"override {item!r}: {k} is not a section")
            node = nxt
        node[keys[-1]] = parse_value(raw)
    return out


def load_spec_data(source: str | Path) -> dict[str, Any]:
    """A preset name (``paper/mnist-sgd``) or a YAML/JSON file path -> the raw dict."""
    from api_schemas.presets import PRESETS

    text_source = str(source)
    if text_source in PRESETS:
        return json.loads(json.dumps(PRESETS[text_source]))
    path = Path(text_source)
    if not path.exists():
        raise SpecError(
            f"spec {text_source!r}: no such file and no such preset (see `tlab presets` for the names)"
        )
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise SpecError(f"spec {path}: the top level must be a mapping of sections (model, dataset, ...)")
    return data


def build_spec(data: dict[str, Any], overrides: list[str] | None = None) -> ExperimentSpec:
    """Validate a raw dict (after overrides) into an ExperimentSpec, or raise SpecError naming the fields."""
    merged = apply_overrides(data, overrides or [])
    try:
        return ExperimentSpec.model_validate(merged)
    except ValidationError as err:
        raise SpecError(format_validation_error(err)) from None


def load_spec(source: str | Path, overrides: list[str] | None = None) -> ExperimentSpec:
    return build_spec(load_spec_data(source), overrides)
