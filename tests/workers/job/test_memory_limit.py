"""A payload's host memory held to ``resources.memory_gb`` (``workers.job.memory_limit``), on real processes: one
that holds more is killed with a line naming the field; pages a forked child shares are counted once; a payload in
its sandbox is the kernel's first OOM victim and cannot put itself below the service's processes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from workers.job.memory_limit import OOM_SCORE_ADJ, MemoryLimit, kill, processes, proportional, resident
from workers.job.sandbox import Mounts, bwrap_argv, unavailable
from workers.on_ray.supervisor import before_payload

# holds MB megabytes (touched, so resident), forks FORK children that share them, says "ready", then sleeps
HOLD = """
import os, sys, time
held = bytearray(int(sys.argv[1]) * 2**20)
for i in range(0, len(held), 4096):
    held[i] = 1
for _ in range(int(sys.argv[2])):
    if os.fork() == 0:
        break
os.write(1, b"ready\\n")  # one write: a parent and its child say it at once
time.sleep(60)
"""


@contextmanager
def hold(mb: int, forks: int = 0) -> Iterator[subprocess.Popen[str]]:
    """A process holding ``mb`` MB (and ``forks`` children sharing them); killed, all of them, on the way out."""
    with subprocess.Popen([sys.executable, "-c", HOLD, str(mb), str(forks)], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            for _ in range(forks + 1):
                assert proc.stdout.readline().strip() == "ready"
            yield proc
        finally:
            kill(processes(proc.pid))


def watched(proc: subprocess.Popen[str], memory_gb: float, seconds: float = 3.0) -> MemoryLimit:
    """``proc`` under a ``MemoryLimit`` of ``memory_gb`` until it is killed or ``seconds`` passed."""
    limit = MemoryLimit(memory_gb, every_s=0.05).start(proc.pid)
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    limit.close()
    return limit


def test_a_payload_over_its_memory_gb_is_killed_saying_what_it_held_and_what_to_set() -> None:
    with hold(300) as proc:
        limit = watched(proc, 0.2, seconds=10)
        assert proc.wait(timeout=5) == -9
        held = float(limit.error.split("held ")[1].split(" GiB")[0])
        assert held > 0.29, limit.error
        assert limit.error.endswith("over resources.memory_gb=0.2: raise resources.memory_gb, or lower "
                                    "training.batch_size (raise training.grad_accumulation to keep the step's batch)")


def test_within_its_memory_gb_or_without_one_a_payload_runs_on() -> None:
    with hold(50) as proc:
        assert watched(proc, 1.0, seconds=1).error == ""
        assert watched(proc, None, seconds=0.3).error == ""
        assert proc.poll() is None


def test_pages_a_forked_child_shares_count_once() -> None:
    """Two processes sharing 200 MB: their resident sets sum to ~400 MB, their proportional sets to ~200; a limit
    between the two keeps them running (resident sets alone would have killed them)."""
    with hold(200, forks=1) as proc:
        procs = processes(proc.pid)
        assert len(procs) == 2
        rss, pss = resident(procs) / 2**20, proportional(procs) / 2**20
        assert rss > 380 and pss < 300, (rss, pss)
        assert watched(proc, 0.3, seconds=1).error == ""
        assert all(p.is_running() for p in procs)


def test_a_process_whose_pss_may_not_be_read_counts_its_resident_set() -> None:
    """A supervisor that is not root may be refused a payload's smaps_rollup: then the payload's RSS counts (an upper
    bound), never 0, which would let it hold anything."""

    class Refused(psutil.Process):
        def memory_full_info(self) -> Any:
            raise psutil.AccessDenied(self.pid)

    with hold(100) as proc:
        rss = resident([psutil.Process(proc.pid)])
        assert proportional([Refused(proc.pid)]) == rss > 100 * 2**20
        assert proportional([psutil.Process(proc.pid)]) <= rss


@pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")
def test_a_sandboxed_payload_is_the_first_oom_victim_and_cannot_put_itself_below_the_service(tmp_path: Path) -> None:
    """It starts at oom_score_adj 1000; it may take itself back to 0, the service's own, never below (EACCES)."""
    probe = ("score = open('/proc/self/oom_score_adj').read().strip()\n"
             "try:\n    with open('/proc/self/oom_score_adj', 'w') as f:\n        f.write('-1')\n"
             "except OSError as err:\n    print(score, 'refused', err.errno)\nelse:\n    print(score, 'lowered')\n")
    argv = bwrap_argv([sys.executable, "-c", probe], {"PATH": "/usr/bin:/bin"}, Mounts(writable=tmp_path))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, preexec_fn=before_payload(1024))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [OOM_SCORE_ADJ, "refused", "13"]  # no CAP_SYS_RESOURCE in the sandbox
