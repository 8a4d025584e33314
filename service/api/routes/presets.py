"""Ready-made specs a user can submit as they are or start from."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api_schemas.presets import PRESET_NOTES, PRESETS
from service.api.deps import CurrentUser
from service.api.responses import AUTHED

router = APIRouter(prefix="/v1/presets", tags=["experiments"], responses=AUTHED)


@router.get("")
def presets(user: CurrentUser) -> dict[str, dict[str, Any]]:
    """Ready-made specs (paper table rows, fast digits demos): ``{name: {note, spec}}``."""
    return {name: {"note": PRESET_NOTES.get(name, ""), "spec": spec} for name, spec in PRESETS.items()}
