"""The driver's start-up timeline (``workers.train.startup``): phases in order, the first time counts, a new job forgets
the last one's."""

from __future__ import annotations

import time

import psutil

from workers.train import startup


def test_phases_come_in_order_first_time_counts_and_begin_forgets() -> None:
    startup.begin()
    for phase in ("model", "torch", "data"):  # marked out of order: reported in PHASES order
        startup.mark(phase)
    first = startup.timeline()
    time.sleep(0.01)
    startup.mark("data")  # a retry passes it again: the first time stands
    again = startup.timeline()
    assert list(first) == ["spawned", "driver", "torch", "data", "model"] and again == first
    # the OS's start time of this process, to its clock tick (psutil's adds a boot time rounded to the second)
    assert abs(first["spawned"] - psutil.Process().create_time()) < 1.01 and first["spawned"] <= first["driver"]
    startup.begin()  # the next job in this process
    assert list(startup.timeline()) == ["spawned", "driver"] and startup.timeline()["driver"] >= first["model"]
