"""Presets: one per row of the paper's hyperparameter table (filled in by the presets work)."""

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {}
