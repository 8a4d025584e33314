"""A joined node leaving (``tlab join``'s Ctrl-C or SIGTERM, or ``tlab leave``): it moves its jobs before it stops.

1. it asks the service to take it out (``POST /v1/nodes/leave``, with the join token it joined with): nothing new
   starts there, and the jobs placed there are stopped (their drivers export from the last checkpoint) and queued
   again, to resume from that checkpoint elsewhere, no failure counted (``service.scheduler.leaving``);
2. it asks Ray to drain it (``service.stack.ray_drain``): Ray places nothing new there either;
3. it waits until the service says no job is placed there any more (``GET /v1/nodes/leave``), saying how it goes,
   for at most its drain timeout (``tlab join --drain-timeout``); a second Ctrl-C (or SIGTERM) ends the wait.

Then ``service.stack.join`` stops its Ray node as before. What it says also goes to ``node/leave.out`` (``tlab leave``
shows it as it comes), and its last line to ``node/left.json`` (``tlab leave``'s answer).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

DRAIN_TIMEOUT_S = 120.0  # how long a leaving node waits for its jobs to move (tlab join --drain-timeout)
POLL_S = 1.0
SAY_EVERY_S = 10.0  # while nothing changes, a line this often
RAY_DRAIN_TIMEOUT_S = 30.0  # the Ray drain's own process (a GCS that does not answer holds nothing up longer)
OUT, LEFT = "leave.out", "left.json"  # in the node's folder


class Leaving:
    """One node's leave: the service's and Ray's parts, and the wait (module doc)."""

    def __init__(self, node: Any, say: Callable[[str], None] | None = None) -> None:
        self.node = node  # a started service.stack.join.JoinedNode
        self.out = Path(node.node_dir) / OUT
        self.say = say or self._say
        self.headers = {"Authorization": f"Bearer {node.token}"}
        self.url = f"{node.api}/v1/nodes/leave"

    def _say(self, line: str) -> None:
        print(line, flush=True)
        with self.out.open("a") as f:
            f.write(line + "\n")

    def ask(self) -> list[str]:
        """Ask the service to take this node out: the jobs placed here (a JoinRefused-like RuntimeError otherwise)."""
        body = {"hostname": self.node.hostname, "address": self.node.address, "wait_s": self.node.drain_s}
        return answer(httpx.post(self.url, headers=self.headers, json=body, timeout=15))

    def still_here(self) -> list[str]:
        """The jobs still placed here (a record gone meanwhile, as a service whose Redis lost it: asked again)."""
        r = httpx.get(self.url, headers=self.headers, params={"address": self.node.address}, timeout=15)
        return self.ask() if r.status_code == 404 else answer(r)

    def drain_ray(self) -> str:
        """Ask Ray's GCS to drain this node (``service.stack.ray_drain``, in a process of its own): one line."""
        argv = [sys.executable, "-m", "service.stack.ray_drain", self.node.gcs, self.node.address,
                str(self.node.ray_temp or ""), str(int(self.node.drain_s)), "tlab leave: this node leaves the cluster"]
        try:
            done = subprocess.run(argv, env=self.node.env(), capture_output=True, text=True,
                                  timeout=RAY_DRAIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"Ray's drain did not answer within {RAY_DRAIN_TIMEOUT_S:g} s"
        said = (done.stdout.strip() or done.stderr.strip() or "").splitlines()
        return said[-1] if said else f"Ray's drain ended with code {done.returncode}"

    def run(self) -> str:
        """Steps 1-3 (module doc); the line that says how it went."""
        self.out.write_text("")
        wait_s = self.node.drain_s
        skip = wait_for_second_signal()
        try:
            first = self.ask()
        except (httpx.HTTPError, RuntimeError, ValueError) as err:  # refused, unreachable, or no JSON
            return self.done(f"the service did not take this node out ({err}); its Ray node stops now, and the jobs "
                             "there resume elsewhere from their last checkpoint once the scheduler sees it gone")
        self.say(f"leaving: the service places nothing more here; {count(first)} placed here"
                 + (": stopping, to resume elsewhere from their last checkpoint" if first else ""))
        self.say(f"leaving: {self.drain_ray()}")
        jobs, deadline, said_at = first, time.monotonic() + wait_s, time.monotonic()
        if jobs:
            self.say(f"leaving: waiting up to {wait_s:g} s (--drain-timeout) for them to move; Ctrl-C again stops "
                     "this node now")
        while jobs and time.monotonic() < deadline and not skip.is_set():
            skip.wait(POLL_S)
            try:
                now_here = self.still_here()
            except (httpx.HTTPError, RuntimeError, ValueError) as err:  # the service restarting: its record stays
                now_here = jobs
                self.say(f"leaving: cannot ask the service how it goes ({err}); asking again")
            if now_here != jobs or time.monotonic() - said_at >= SAY_EVERY_S:
                said_at = time.monotonic()
                moved = [j for j in jobs if j not in now_here]
                self.say(f"leaving: {count(now_here)} still here" + (f"; moved: {', '.join(moved)}" if moved else "")
                         + f" ({max(0.0, deadline - time.monotonic()):.0f} s left)")
            jobs = now_here
        moved = [j for j in first if j not in jobs]
        if not first:
            return self.done("this node left the cluster; no job ran there")
        if not jobs:
            return self.done(f"this node left the cluster: {count(moved)} moved ({', '.join(moved)}), to resume "
                             "elsewhere from their last checkpoint")
        why = "on a second Ctrl-C" if skip.is_set() else f"after {wait_s:g} s (--drain-timeout)"
        return self.done(f"this node left the cluster {why} with {count(jobs)} still there ({', '.join(jobs)}): they "
                         "resume elsewhere from their last checkpoint once their attempts are seen ended" +
                         (f"; moved: {', '.join(moved)}" if moved else ""))

    def done(self, line: str) -> str:
        """The leave's last line: printed here, and ``tlab leave``'s answer (not in ``OUT``: it is shown once)."""
        print(line, flush=True)
        (Path(self.node.node_dir) / LEFT).write_text(json.dumps({"said": line}) + "\n")
        return line


def drain_timeout(given: float | None) -> float:
    """``--drain-timeout``, else ``TLAB_DRAIN_TIMEOUT_S``, else ``DRAIN_TIMEOUT_S`` (ValueError: not seconds)."""
    seconds = given if given is not None else float(os.environ.get("TLAB_DRAIN_TIMEOUT_S") or DRAIN_TIMEOUT_S)
    if not 0 <= seconds <= 86400:
        raise ValueError(f"--drain-timeout / TLAB_DRAIN_TIMEOUT_S: {seconds:g} s is not between 0 and 86400")
    return seconds


def answer(r: httpx.Response) -> list[str]:
    """The ids of the jobs still placed on the node, from the service's ``LeaveStatus``; RuntimeError on a refusal."""
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {detail(r)}")
    return [str(j) for j in r.json().get("jobs") or []]


def detail(r: httpx.Response) -> str:
    """What the service said when it refused (its ErrorBody's ``detail``, else the body)."""
    try:
        return str(r.json().get("detail") or r.text)
    except ValueError:
        return r.text


def count(jobs: list[str]) -> str:
    return f"{len(jobs)} job{'' if len(jobs) == 1 else 's'}"


def wait_for_second_signal() -> threading.Event:
    """An event set by the next SIGINT or SIGTERM (the first one started the leave)."""
    again = threading.Event()
    if threading.current_thread() is threading.main_thread():  # where Python lets signals be handled
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: again.set())
    return again


def said(node_dir: Path) -> str:
    """What the last leave from ``node_dir`` said it did ('' when not known)."""
    try:
        return str(json.loads((node_dir / LEFT).read_text())["said"])
    except (OSError, ValueError, KeyError):
        return ""
