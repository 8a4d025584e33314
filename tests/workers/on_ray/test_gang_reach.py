"""A rank that cannot reach rank 0's store fails its try in seconds with one line naming both ends, not after the
gang's timeout (minutes): real sockets, a real ``torch.distributed`` join."""

from __future__ import annotations

import socket

import pytest
import torch

from api_schemas import ExperimentSpec
from tests.service.conftest import tiny
from workers.on_ray import gang


def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connection to it is refused
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_rank_reaches_a_listening_store_and_fails_one_line_on_a_port_nobody_serves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        gang.reach("127.0.0.1", listening.getsockname()[1], rank=1, within_s=5)  # returns: reachable
    port = closed_port()
    monkeypatch.setattr(gang, "REACH_S", 1.0)
    monkeypatch.setenv("TLAB_GANG_TIMEOUT_S", "600")  # the store's own wait would be minutes
    spec = ExperimentSpec.model_validate(tiny(resources={"workers": 2}))
    with pytest.raises(ConnectionError) as err:
        gang.join("127.0.0.1", port, 1, spec, torch.device("cpu"))
    line = str(err.value)
    assert "\n" not in line and f"rank 1 on {socket.gethostname()} cannot reach rank 0 at 127.0.0.1:{port}" in line
    assert "within 1 s" in line and "firewall" in line
