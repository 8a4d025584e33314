"""Teleport Lab's Python client, for notebooks and scripts: no torch, no Ray (docs/client.md).

>>> import tlab
>>> lab = tlab.connect()               # TLAB_URL and TLAB_TOKEN, else the local `tlab up`'s files
>>> run = lab.submit("mnist_mlp", set={"training.epochs": 3})          # doctest: +SKIP
>>> run.wait().metrics()               # a pandas DataFrame, one row per epoch      # doctest: +SKIP
"""

from __future__ import annotations

from tlab.client import Client, load_spec
from tlab.http import ApiError, Event
from tlab.runs import Experiment, Sweep

__all__ = ["ApiError", "Client", "Event", "Experiment", "Sweep", "connect", "load_spec"]


def connect(url: str | None = None, token: str | None = None, timeout: float = 30.0) -> Client:
    """A client of the API at ``url`` (default ``TLAB_URL``, else the local ``tlab up``'s) signed in with ``token``
    (default ``TLAB_TOKEN``, else the local admin's).

    >>> lab = tlab.connect("http://lab-gpu:8470", token="...")   # doctest: +SKIP
    >>> lab.json("GET", "/v1/me")["name"]                          # doctest: +SKIP
    """
    return Client(url, token, timeout)
