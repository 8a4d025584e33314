"""What the service benchmark's parts share: sizes, floors, a tiny spec, percentiles, CPU meters, an API-only stack."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from service.stack.embedded import Stack

# the simulated cluster the API-only stack checks submissions against (tests/service/conftest.py's)
STATIC_NODES = json.dumps([{"id": "n1", "cpus": 4, "gpus": 1}, {"id": "n2", "cpus": 4, "gpus": 1}])
TINY = {"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [32]},
        "training": {"epochs": 2, "batch_size": 64}, "teleport": {"enabled": False}}
LOADGEN_NOTE = ("the load generator (this process) shares the machine's cores with the API and Redis: "
                "client CPU time is part of what is measured")

FLOORS = {"submit_per_s": 300.0, "submit_p99_ms": 50.0, "sse_p99_ms": 100.0, "decision_ms": 10.0}


@dataclass
class Sizes:
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    submit_seconds: float = 5.0
    followers: int = 200
    events_per_s: float = 100.0
    sse_seconds: float = 10.0
    connect_batch: int = 25
    queued: int = 1000
    users: int = 10
    active: int = 12
    decide_repeats: int = 50
    e2e_jobs: int = 3
    e2e_timeout_s: float = 180.0

    @classmethod
    def quick(cls) -> Sizes:
        return cls(submit_seconds=2.0, followers=50, sse_seconds=3.0, decide_repeats=20, e2e_jobs=1,
                   e2e_timeout_s=120.0)

def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); nan for no samples."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{1000 * x:.1f}"


CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(rest[11]) + int(rest[12])) / CLK  # fields 14 and 15: utime, stime


class CpuMeter:
    """CPU seconds used by this process and some child processes between start() and stop()."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0: dict[str, float] = {}
        self.wall0 = 0.0

    def _now(self) -> dict[str, float]:
        out = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        out["loadgen"] = time.process_time()
        return out

    def start(self) -> CpuMeter:
        self.t0, self.wall0 = self._now(), time.perf_counter()
        return self

    def stop(self) -> dict[str, float]:
        now, wall = self._now(), time.perf_counter() - self.wall0
        out = {f"{k}_cpu_s": round(now[k] - self.t0[k], 3) for k in now}
        out["wall_s"] = round(wall, 3)
        return out


def api_only_stack(home: Path) -> Stack:
    # the SSE part's followers are all the admin's: over TLAB_MAX_STREAMS_PER_USER's 16 (429) without this
    stack = Stack(home, ray_address="http://127.0.0.1:9",
                  extra_env={"TLAB_CLUSTER_NODES": STATIC_NODES, "TLAB_MAX_STREAMS_PER_USER": "1000"})
    home.mkdir(parents=True, exist_ok=True)
    stack.start_redis()
    stack.ensure_admin()
    stack.start_service(("api",))
    return stack
