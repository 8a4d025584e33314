"""``tlab up`` keeps its parts up: a child that dies (Redis, the Ray head, the API, the scheduler) is restarted
after a back-off (``TLAB_RESTART_BACKOFF_S`` doubling up to ``TLAB_RESTART_BACKOFF_MAX_S``) while the others
keep running; more than ``TLAB_CRASH_LOOP_RESTARTS`` restarts of one part within ``TLAB_CRASH_LOOP_WINDOW_S``
is a crash loop, which stops the stack with one message naming the part and its log.

``Restarts`` is the pure rule (one part's history, the clock passed in); ``Supervisor`` applies it to a
``service.stack.embedded.Stack``, whose ``reap`` / ``restart`` keep each part's ports, secrets and files. What it says
goes to stderr and to ``$TLAB_HOME/logs/supervisor.log`` (the crash loop's message: printed by ``up`` last).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.stack.embedded import Interrupted, Stack


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.5  # before the first restart in a window; doubled for each restart before it
    backoff_max_s: float = 10.0
    max_restarts: int = 5  # restarts of one part within window_s; one more death is a crash loop
    window_s: float = 60.0


class SuperviseSettings(BaseSettings):
    """The restart policy from the environment (``TLAB_RESTART_*``, ``TLAB_CRASH_LOOP_*``)."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    backoff_s: float = Field(0.5, gt=0, le=3600, validation_alias="TLAB_RESTART_BACKOFF_S")
    backoff_max_s: float = Field(10.0, gt=0, le=3600, validation_alias="TLAB_RESTART_BACKOFF_MAX_S")
    max_restarts: int = Field(5, ge=0, le=1000, validation_alias="TLAB_CRASH_LOOP_RESTARTS")
    window_s: float = Field(60.0, gt=0, le=86400, validation_alias="TLAB_CRASH_LOOP_WINDOW_S")


def supervise_policy() -> RestartPolicy:
    """The policy the environment sets; a bad value exits with one line naming the variable."""
    try:
        s = SuperviseSettings()
    except ValidationError as err:
        first = err.errors()[0]
        raise SystemExit(f"tlab up: {first['loc'][0]}: {first['msg']} (got {first.get('input')!r})") from None
    return RestartPolicy(s.backoff_s, max(s.backoff_s, s.backoff_max_s), s.max_restarts, s.window_s)


@dataclass
class Restarts:
    """One part's restarts within the policy's window."""

    policy: RestartPolicy
    times: list[float] = field(default_factory=list)

    def after_exit(self, now: float) -> tuple[int, float] | None:
        """A death at ``now``: (this restart's number within the window, its delay), or None for a crash loop.
        The delay doubles with each restart still in the window, so a part that stays up long enough starts
        over at the shortest back-off."""
        self.times = [t for t in self.times if now - t < self.policy.window_s]
        if len(self.times) >= self.policy.max_restarts:
            return None
        delay = min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** len(self.times))
        self.times.append(now)
        return len(self.times), delay


def exit_line(name: str, code: object, number: int, delay: float, policy: RestartPolicy, log: Path) -> str:
    return (f"{name} exited with code {code}; restarting in {delay:.1f} s (restart {number} of "
            f"{policy.max_restarts} in the last {policy.window_s:g} s); log: {log}")


def crash_loop_line(name: str, code: object, policy: RestartPolicy, log: Path) -> str:
    return (f"{name} keeps dying (exit code {code}; {policy.max_restarts} restarts within {policy.window_s:g} s, "
            f"TLAB_CRASH_LOOP_RESTARTS / TLAB_CRASH_LOOP_WINDOW_S): stopping the stack. Its log: {log}")


class Supervisor:
    """Watch a started ``Stack``'s children; restart one that dies; stop on a crash loop or when asked."""

    def __init__(self, stack: Stack, policy: RestartPolicy, say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 0.2) -> None:
        self.stack, self.policy, self.clock, self.poll_s = stack, policy, clock, poll_s
        self.say = say or self._say
        self.restarts: dict[str, Restarts] = {}
        self.due: dict[str, tuple[float, float]] = {}  # part -> (restart at, died at)

    def log(self, name: str) -> Path:
        return self.stack.logs / f"{name}.log"

    def _say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        self.record(line)

    def record(self, line: str) -> None:
        self.stack.logs.mkdir(parents=True, exist_ok=True)
        with (self.stack.logs / "supervisor.log").open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")

    def run(self, stopping: threading.Event) -> str | None:
        """Until ``stopping`` is set (None), or a part's crash loop (the message that says so)."""
        while not stopping.is_set():
            for name, proc in list(self.stack.procs.items()):
                if proc.poll() is not None:
                    stop = self.died(name, proc.returncode)
                    if stop:
                        return stop
            for name, (at, died_at) in sorted(self.due.items()):
                if self.clock() >= at and not stopping.is_set():
                    stop = self.bring_back(name, died_at)
                    if stop:
                        return stop
            stopping.wait(self.poll_s)
        return None

    def died(self, name: str, code: object) -> str | None:
        """Clear what ``name`` left and plan its restart; the crash loop's message when it has had its share."""
        now = self.clock()
        self.stack.reap(name)
        verdict = self.restarts.setdefault(name, Restarts(self.policy)).after_exit(now)
        if verdict is None:
            line = crash_loop_line(name, code, self.policy, self.log(name))
            self.record(line)  # the caller prints it last, after the stack stopped
            return line
        number, delay = verdict
        self.say(exit_line(name, code, number, delay, self.policy, self.log(name)))
        died_at = self.due.pop(name, (0.0, now))[1]  # a failed restart counts from the first death
        self.due[name] = (now + delay, died_at)
        return None

    def bring_back(self, name: str, died_at: float) -> str | None:
        del self.due[name]
        try:
            self.stack.restart(name)
        except Interrupted:
            return None  # the stack is stopping
        except Exception as err:  # it died again or hung while starting: one more death
            self.record(f"restarting {name} failed:\n{traceback.format_exc()}")
            self.due[name] = (0.0, died_at)
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            return self.died(name, f"none ({first})")
        self.say(f"{name} is back, {self.clock() - died_at:.1f} s after it exited")
        return None
