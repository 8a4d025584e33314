"""A driver that died without a word (service.scheduler.deaths): its signal, the one line, the OOM evidence, and the
retry budget over attempts, on a real Redis. The real kill -9 of a running driver is in test_e2e."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from api_schemas import ExperimentSpec, keys
from api_schemas.jobs import ExperimentSubmit, JobState
from api_schemas.reasons import ENDED_EXIT
from api_schemas.vitals import DriverVitals
from service.core.settings import Settings
from service.core.store import Store
from service.scheduler import deaths
from workers.job.vitals import current, oom_file

GB = 10**9


def test_the_signal_comes_from_the_exit_status_and_an_own_exit_is_none() -> None:
    assert [deaths.killed_by(c) for c in (-9, 137, -11, 143, 0, 1, 2, None)] == [9, 9, 11, 15, None, None, None,
                                                                                  None]


def test_the_line_says_what_happened_and_suggests_memory_where_the_os_says_oom() -> None:
    v = DriverVitals(pid=7, peak_rss_bytes=int(3.2 * GB))
    assert deaths.death_line(9, 11, v, None) == "driver killed by SIGKILL at epoch 11 (out of memory? peak RSS 3.2 GB)"
    assert deaths.death_line(9, 11, v, True) == (
        "driver killed by SIGKILL at epoch 11 (out of memory: the kernel's OOM killer ended it, peak RSS 3.2 GB; "
        "set resources.memory_gb to 5 or more)")
    assert deaths.death_line(11, None, None, None) == "driver killed by SIGSEGV before its first epoch"


def test_an_oom_kill_is_read_from_the_drivers_cgroup_counter_and_only_under_the_cgroup_root(tmp_path: Path) -> None:
    events = tmp_path / "job.slice" / "memory.events"
    events.parent.mkdir()
    events.write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    v = DriverVitals(pid=7, oom_file=str(events), oom_kills=1)
    assert not deaths.cgroup_counted_oom(v, root=str(tmp_path))  # not grown since the driver started
    events.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    assert deaths.cgroup_counted_oom(v, root=str(tmp_path))
    assert not deaths.cgroup_counted_oom(v)  # a file outside /sys/fs/cgroup is never read
    other = tmp_path / "secrets.txt"
    other.write_text("oom_kill 99\n")
    assert not deaths.cgroup_counted_oom(v.model_copy(update={"oom_file": str(other)}), root=str(tmp_path))


def test_a_driver_reads_its_own_vitals_here() -> None:
    v = current()
    assert v.peak_rss_bytes > 10**7 and v.boot_id == deaths.this_boot()
    assert deaths.oom_verdict(v) is False  # this machine's kernel says no OOM kill of this process
    assert deaths.oom_verdict(v.model_copy(update={"boot_id": "another-machine"})) is None
    if v.oom_file:  # cgroup v1 or v2, whichever this machine has
        assert Path(v.oom_file).name in ("memory.events", "memory.oom_control") and v.oom_kills is not None
    assert oom_file("0::/\n") in ("", "/sys/fs/cgroup/memory.events")


def said(store: Store, job: str) -> str:
    """The reason of the job's last status event (what the page and `tlab get` show of a move)."""
    return next(json.loads(f["data"]).get("reason", "") for _, f in store.r.xrevrange(keys.events(job))
                if f["kind"] == "status")


def running(store: Store, spec: dict, attempts: int) -> dict[str, str]:
    job, *_ = store.submit("alice", ExperimentSubmit(spec=ExperimentSpec.model_validate(spec)))
    assert store.transition(job, JobState.STARTING, attempts=str(attempts))
    assert store.transition(job, JobState.RUNNING)
    return store.raw(job)


@pytest.mark.parametrize("max_retries", [2, 0])
def test_a_killed_driver_is_queued_again_until_its_retries_are_used(redis_server: str, tmp_path: Path,
                                                                    max_retries: int) -> None:
    store, settings = Store.from_url(redis_server), Settings(TLAB_STORAGE=str(tmp_path))
    spec = {"resources": {"max_retries": max_retries}, "training": {"epochs": 3}}
    data = running(store, spec, attempts=1)
    store.r.hset(keys.job(data["id"]), "vitals", DriverVitals(pid=1, peak_rss_bytes=2 * GB).model_dump_json())
    assert deaths.died(store, settings, data, -9, time.time()) is True
    after = store.raw(data["id"])
    if max_retries:
        assert after["state"] == "queued"
        assert said(store, data["id"]) == ("driver killed by SIGKILL before its first epoch (out of memory? peak RSS "
                                           "2.0 GB); retrying from its start, attempt 2 of 3")
    else:
        assert after["state"] == "failed" and after["failure_reason"].endswith(
            "not retried: 1 attempts failed (resources.max_retries=0)")
    last = running(store, spec, attempts=max_retries + 1)  # the last allowed attempt dies too: failed
    assert deaths.died(store, settings, last, 143, time.time()) is True
    assert store.raw(last["id"])["state"] == "failed"
    assert store.raw(last["id"])["failure_reason"].startswith("driver killed by SIGTERM before its first epoch; not")
    assert deaths.died(store, settings, running(store, spec, 1), 1, time.time()) is False  # its own exit: not ours
    lost = running(store, spec, 1)  # a driver that lost Redis for its lease ended itself (workers.job.fence)
    assert deaths.died(store, settings, lost, ENDED_EXIT, time.time()) is True
    assert store.raw(lost["id"])["state"] == ("queued" if max_retries else "failed")


def test_the_peak_rss_counts_the_drivers_children() -> None:
    """The training may run in a sandboxed child of the driver: its memory is what the OOM killer weighs."""
    import subprocess
    import sys

    from workers.job.vitals import peak_rss_bytes

    alone = peak_rss_bytes()
    child = subprocess.Popen([sys.executable, "-c", "import sys; x = bytearray(100 * 10**6); sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while peak_rss_bytes() < alone + 100 * 10**6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert peak_rss_bytes() >= alone + 100 * 10**6
    finally:
        child.communicate(b"")
