"""The CLI's client is the notebook's: ``tlab.Client`` (this module keeps the names the commands import)."""

from __future__ import annotations

from tlab.client import Client
from tlab.http import ApiError, Event, local_home, parse_sse

__all__ = ["ApiError", "Client", "Event", "home", "parse_sse"]


def home():  # noqa: ANN201 - the path ``tlab up`` keeps its files in (TLAB_HOME, else the default)
    return local_home()
