"""Where a local stack takes its ports, in the standard library alone: the test suite sets its ranges up before it
knows whether a service test runs (a machine with torch alone, a lent GPU, runs the teleport tests too)."""

from __future__ import annotations

import os
import random
import socket

_GIVEN: set[int] = set()
PORT_RANGE = "20000-32767"  # above Ray's worker ports (10002-19999), below Linux's ephemeral ports (32768-60999)


def port_range() -> range:
    """Where a stack takes its ports: ``TLAB_PORT_RANGE`` (``lo-hi``). Outside the kernel's ephemeral range, which
    every outgoing connection and every ``bind(0)`` (Ray's own, torch's stores) draws from, a port a stack chose
    stays free while one of its parts is down, so the part restarts on it."""
    text = os.environ.get("TLAB_PORT_RANGE") or PORT_RANGE
    lo, _, hi = text.partition("-")
    if not (lo.strip().isdigit() and hi.strip().isdigit() and 1024 <= int(lo) < int(hi) <= 65535):
        raise ValueError(f"TLAB_PORT_RANGE={text!r}: give two port numbers lo-hi, 1024 <= lo < hi <= 65535")
    return range(int(lo), int(hi) + 1)


def free_port() -> int:
    """A free loopback port of ``port_range()``, at random, never one this process handed out before: Ray
    refuses to start when two of its components are given the same one."""
    ports = port_range()
    for _ in range(4 * len(ports)):
        port = random.choice(ports)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in TLAB_PORT_RANGE {ports.start}-{ports.stop - 1}: widen it")
