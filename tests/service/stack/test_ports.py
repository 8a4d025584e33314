"""A stack's ports: drawn from TLAB_PORT_RANGE (outside the kernel's ephemeral range), free, never handed out twice."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from service.stack import embedded as stack
from service.stack import ports
from service.stack.up import up


@pytest.fixture()
def fresh(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    given: set[int] = set()
    monkeypatch.setattr(ports, "_GIVEN", given)
    return given


def test_the_default_range_lies_between_rays_worker_ports_and_the_ephemeral_ports(
        monkeypatch: pytest.MonkeyPatch, fresh: set[int]) -> None:
    monkeypatch.delenv("TLAB_PORT_RANGE", raising=False)
    ports = stack.port_range()
    assert ports.start > 19999  # Ray's --max-worker-port default
    low, _high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert ports.stop - 1 < low  # what bind(0) and every outgoing connection draw from
    assert stack.free_port() in ports


def free_block(size: int) -> int:
    """The first port of ``size`` consecutive ports of this worker's range that nothing listens on now."""
    for first in range(stack.port_range().start, stack.port_range().stop - size, size):
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + size):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise AssertionError("no free block of ports")


def test_ports_come_from_the_range_each_once_and_an_exhausted_range_names_the_setting(
        monkeypatch: pytest.MonkeyPatch, fresh: set[int]) -> None:
    first = free_block(10)
    monkeypatch.setenv("TLAB_PORT_RANGE", f"{first}-{first + 9}")
    with socket.socket() as taken:  # a port someone listens on is skipped
        taken.bind(("127.0.0.1", first + 4))
        taken.listen()
        got = [stack.free_port() for _ in range(9)]
        assert sorted(got) == [p for p in range(first, first + 10) if p != first + 4]
        with pytest.raises(RuntimeError, match=f"no free port in TLAB_PORT_RANGE {first}-{first + 9}: widen it"):
            stack.free_port()


@pytest.mark.parametrize("text", ["20000", "30000-20000", "80-90", "20000-70000", "a-b"])
def test_tlab_up_refuses_a_malformed_range_with_one_line_before_starting_anything(
        text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TLAB_PORT_RANGE", text)
    assert up(tmp_path / "home", None, None) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: TLAB_PORT_RANGE={text!r}: give two port numbers lo-hi, 1024 <= lo < hi <= 65535")
    assert not (tmp_path / "home" / "logs").exists()  # nothing was started
