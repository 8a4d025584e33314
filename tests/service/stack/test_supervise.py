"""`tlab up` supervises its parts: the restart rule on its own (pure), and kill -9 of the scheduler, Redis and
the Ray GCS under a running job (real `tlab up`, real Redis and Ray): each comes back on its ports, the job
succeeds with every epoch exactly once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import redis

from api_schemas import keys
from service.cli.client import Client
from service.stack.supervise import RestartPolicy, Restarts, Supervisor, crash_loop_line, exit_line
from tests.service.conftest import Api, tiny, tlab_up

POLICY = RestartPolicy(backoff_s=0.5, backoff_max_s=10.0, max_restarts=5, window_s=60.0)


def test_back_off_doubles_to_its_cap_and_a_crash_loop_ends_it() -> None:
    r = Restarts(POLICY)
    assert [r.after_exit(float(t)) for t in range(5)] == [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0)]
    assert r.after_exit(5.0) is None  # a sixth death within 60 s
    capped = Restarts(RestartPolicy(backoff_s=1.0, backoff_max_s=3.0, max_restarts=10, window_s=60.0))
    assert [capped.after_exit(float(t))[1] for t in range(4)] == [1.0, 2.0, 3.0, 3.0]  # type: ignore[index]


def test_restarts_older_than_the_window_are_forgotten() -> None:
    r = Restarts(POLICY)
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        r.after_exit(t)
    assert r.after_exit(62.0) == (3, 2.0)  # the deaths at 0, 1 and 2 s left the window
    assert r.after_exit(500.0) == (1, 0.5)  # quiet for a window: the shortest back-off again
    assert Restarts(RestartPolicy(max_restarts=0)).after_exit(0.0) is None  # never restart


def test_the_lines_name_the_part_its_code_and_its_log() -> None:
    log = Path("/h/logs/scheduler.log")
    assert exit_line("scheduler", -9, 2, 1.0, POLICY, log) == (
        "scheduler exited with code -9; restarting in 1.0 s (restart 2 of 5 in the last 60 s); "
        "log: /h/logs/scheduler.log")
    line = crash_loop_line("scheduler", 1, POLICY, log)
    assert line.startswith("scheduler keeps dying") and line.endswith(str(log))


def test_a_killed_api_comes_back_on_its_port_and_a_crash_loop_stops_with_one_message(api_only: Api) -> None:
    stack, said, ended = api_only.stack, [], []
    supervisor = Supervisor(stack, RestartPolicy(backoff_s=0.1, max_restarts=1), say=said.append, poll_s=0.05)
    stopping = threading.Event()
    thread = threading.Thread(target=lambda: ended.append(supervisor.run(stopping)))
    thread.start()
    try:
        os.kill(stack.procs["api"].pid, signal.SIGKILL)
        wait("the API back", lambda: any(line.startswith("api is back") for line in said), timeout=60)
        assert said[0].startswith("api exited with code -9; restarting in 0.1 s (restart 1 of 1 in the last 60 s)")
        with api_only.client() as c:  # the same URL and token
            assert c.get("/v1/me").status_code == 200
        os.kill(stack.procs["api"].pid, signal.SIGKILL)  # a second death within the window: a crash loop
        thread.join(timeout=30)
        assert ended == [crash_loop_line("api", -9, supervisor.policy, stack.logs / "api.log")]
        assert "api" not in stack.procs
    finally:
        stopping.set()
        thread.join(timeout=30)


# ---- the real stack --------------------------------------------------------------------------------------------
EPOCHS = 30
SPEC = tiny(training={"epochs": EPOCHS, "batch_size": 2})  # ~0.4 s an epoch: it runs on through the kills


def part(up: psutil.Process, match: Callable[[psutil.Process], bool]) -> psutil.Process:
    for p in up.children(recursive=True):
        try:
            if match(p):
                return p
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no such child of tlab up")


def is_scheduler(p: psutil.Process) -> bool:
    return "service.scheduler" in p.cmdline()


def is_api(p: psutil.Process) -> bool:
    return "service.api" in p.cmdline()


def is_redis(p: psutil.Process) -> bool:
    return p.name().startswith("redis")


def is_gcs(p: psutil.Process) -> bool:
    return p.name() == "gcs_server"


def of_stack(home: Path) -> list[psutil.Process]:
    """Processes started for the stack in ``home`` (every child of `tlab up`, down to Ray's job drivers, inherits
    ``TLAB_HOME``)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TLAB_HOME") == str(home) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def kill(up: psutil.Process, match: Callable[[psutil.Process], bool]) -> float:
    part(up, match).send_signal(signal.SIGKILL)
    return time.monotonic()


def listen_port(p: psutil.Process) -> int:
    return next(c.laddr.port for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN)


def wait(what: str, check: Callable[[], object], timeout: float = 120.0) -> float:
    """Poll ``check`` (errors count as not yet) until it holds; the monotonic time it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return time.monotonic()
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout:g} s")


class Watch:
    """The stack's Redis, read as the test's own client (the password from TLAB_HOME)."""

    def __init__(self, home: Path, port: int) -> None:
        self.r = redis.Redis(port=port, password=(home / "redis.password").read_text().strip(),
                             decode_responses=True, socket_timeout=5)

    def epochs(self, job: str) -> list[int]:
        return [json.loads(f["data"])["epoch"] for _, f in self.r.xrange(keys.events(job)) if f["kind"] == "metric"]

    def resumed_from(self, job: str) -> list[int]:
        """The epoch each start of the training loop went on from (0: from scratch)."""
        data = [json.loads(f["data"]) for _, f in self.r.xrange(keys.events(job))]
        return [d["resumed_from_epoch"] for d in data if d.get("kind") == "start"]

    def published_at(self) -> float:
        raw = self.r.get(keys.cluster())
        return float(json.loads(raw)["at"]) if raw else 0.0


@pytest.mark.slow
@pytest.mark.drill
def test_tlab_up_restarts_a_killed_scheduler_redis_and_ray_head_and_the_job_goes_on(
        up_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"TLAB_TICK_S": "0.2", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1"}.items():
        monkeypatch.setenv(name, value)
    home, took = up_home, {}
    with tlab_up(home, "--num-cpus", "2") as (proc, url, _printed):
        up = psutil.Process(proc.pid)
        api = part(up, is_api)
        redis_port = listen_port(part(up, is_redis))
        watch = Watch(home, redis_port)
        with Client(url, (home / "admin.token").read_text().strip()) as c:
            job = c.submit(SPEC, name="supervised")["id"]
            wait("a first epoch", lambda: watch.epochs(job))

            # the Ray GCS: the head restarts as a unit and has forgotten the job; the scheduler queues it again
            t0 = kill(up, is_gcs)
            took["ray: job submitted again"] = wait("the job restarted on a new Ray head",
                                                    lambda: c.get(job)["attempts"] == 2, timeout=180) - t0
            seen = len(watch.epochs(job))  # the old driver may have added one before it died
            took["ray: next epoch"] = wait("the job resumed", lambda: len(watch.epochs(job)) > seen) - t0

            # Redis: back on its port from its AOF; the job's driver writes on
            seen = len(watch.epochs(job))
            assert seen < EPOCHS - 3, "the job ran out of epochs before Redis was killed"
            t0, killed_at = kill(up, is_redis), time.time()
            took["redis"] = wait("Redis back", watch.r.ping) - t0
            assert listen_port(part(up, is_redis)) == redis_port  # the same URL for everyone
            took["redis: next epoch"] = wait("an epoch after Redis came back",
                                             lambda: len(watch.epochs(job)) > seen) - t0

            # the scheduler: the job runs on; the next scheduler takes over at once
            wait("a scheduler deciding since Redis came back", lambda: watch.published_at() > killed_at)
            t0, killed_at = kill(up, is_scheduler), time.time()  # (a Redis restart may have restarted it too)
            took["scheduler"] = wait("the scheduler back", lambda: watch.published_at() > killed_at) - t0

            view = c.get(job)
            while view["state"] not in ("succeeded", "failed", "cancelled"):
                time.sleep(0.3)
                view = c.get(job)
            assert view["state"] == "succeeded", view
            assert watch.epochs(job) == list(range(EPOCHS))  # each exactly once, across the three restarts
            assert view["attempts"] == 2  # the Ray head forgot it once: queued again, resumed from its checkpoint
            starts = watch.resumed_from(job)
            assert len(starts) >= 2 and starts[0] == 0 and all(e > 0 for e in starts[1:]), starts
            assert part(up, is_api).pid == api.pid  # the API never went down meanwhile
        said = (home / "logs" / "supervisor.log").read_text()
        for name in ("scheduler", "redis", "ray"):
            assert f"{name} exited with code" in said and f"{name} is back" in said, said
        assert proc.poll() is None  # no crash loop
        kill(up, is_gcs)  # and Ctrl-C (the fixture's, on the way out) while the head is being restarted
        wait("the head's restart begun", lambda: (home / "logs" / "supervisor.log").read_text().count(
            "ray exited") == 2, timeout=60)
        time.sleep(1.0)
    assert proc.returncode == 0
    wait("every process of the stack gone", lambda: not of_stack(home), timeout=30)
    print("recovery (s):", json.dumps({k: round(v, 1) for k, v in took.items()}))


def test_a_tick_failing_the_same_way_logs_its_traceback_once(caplog: pytest.LogCaptureFixture) -> None:
    """While Ray's head is down every tick fails alike: one traceback, then a line a minute, not one per tick."""
    import logging

    from service.scheduler.repeated import RepeatedErrors

    quiet = RepeatedErrors(logging.getLogger("tlab.test"), every_s=3600)
    with caplog.at_level(logging.WARNING, logger="tlab.test"):
        for _ in range(50):
            quiet.report(ConnectionError("the Ray head at 127.0.0.1:8265 is down"))
        quiet.report(ValueError("something else"))
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(caplog.records) == 2 and len(tracebacks) == 2
    assert "ConnectionError" in caplog.text and "something else" in caplog.text
