"""A cluster of real hosts (``tests.hosts.netns``: own address, host name, processes, /tmp and storage cache each; a
host name that resolves to 127.0.1.1, as on Debian): ``tlab up --listen`` on the serving host, ``tlab join`` with
nothing but a join token on the others. A 2-rank gang trains across two hosts; a host killed mid-run and a host cut
off mid-run are declared lost, their job requeued and resumed from the bucket on what is left, every epoch once; a
host that leaves mid-run (``tlab leave``) has its job moved first, which resumes on another host, every epoch once,
nothing declared lost; a cut-off host healed after its job succeeded lands nothing (``tlab pull``'s files, the
bucket, the stream unchanged); the serving host's Redis killed while a gang trains across two hosts; a 4-trial
sweep spread over the hosts.

The tests share one lab and run in order (each leaves three hosts joined for the next). Figures (seconds from the
kill, the cut or the leave to the requeue and to the first resumed epoch) are printed: ``pytest -s``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import redis

from api_schemas import keys
from objstore import Bucket
from service.rules.preemptible import PREEMPTED_BY
from tests.hosts.conftest import NODE_HOME, Head
from tests.hosts.conftest import TLAB as TLAB_CLI
from tests.hosts.netns import Host, Lab, available
from tests.service.conftest import tiny, wait_for
from tests.service.scheduler.test_preemption import events

WHY_NOT = available()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),  # a lab starts Ray four times: minutes on a busy machine
              pytest.mark.skipif(bool(WHY_NOT), reason=f"no hosts here: {WHY_NOT}")]

LOST_WITHIN_S = 20.0  # a cut-off host is declared lost within this (Ray's health checks as tlab up sets them)
GANG = {"workers": 2}  # 1 CPU each: one rank per 1-CPU host
LONG = {"epochs": 100_000, "max_steps_per_epoch": 1}
CUT_THEN_SUCCEED = {"epochs": 400, "max_steps_per_epoch": 1}  # outlasts the cut, ends once resumed


def view(c: httpx.Client, job: str) -> dict[str, Any]:
    return dict(c.get(f"/v1/experiments/{job}").raise_for_status().json())


STARTED: list[str] = []  # what the running test submitted: experiments/<id>, sweeps/<id>


def submit(c: httpx.Client, spec: dict[str, Any], name: str) -> str:
    r = c.post("/v1/experiments", json={"spec": spec, "name": name})
    assert r.status_code == 201, r.text
    job = str(r.json()["id"])
    STARTED.append(f"experiments/{job}")
    return job


@pytest.fixture(autouse=True)
def cancel_what_it_started(head: Head) -> Iterator[None]:
    """Whatever a test submitted is cancelled when it ends, its checks held or not (a cancel of an ended job is a
    no-op): a job of 100,000 epochs left running would hold a host through every later test."""
    yield
    with head.client() as c:
        for path in STARTED:
            c.post(f"/v1/{path}/cancel")
    STARTED.clear()


def wait(c: httpx.Client, job: str, ok: Any, what: str, timeout: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not ok(v := view(c, job)):
        assert v["state"] != "failed", f"{job} failed while waiting for {what}: {v['failure_reason']}"
        assert time.monotonic() < deadline, f"{job}: {what} not within {timeout:g} s; {v}"
        time.sleep(0.2)
    return v


def epochs_of(head: Head, job: str) -> list[int]:
    return [m["epoch"] for m in events(head.redis, job, "epoch")]


def placed_hosts(head: Head, job: str) -> list[str]:
    """The host names of the nodes the job's ranks were placed on."""
    names = {n["id"]: n["hostname"] for n in head.nodes()}
    return [names.get(node, node) for node in json.loads(head.redis.hget(keys.job(job), "placement") or "[]")]


def end(c: httpx.Client, job: str) -> None:
    c.post(f"/v1/experiments/{job}/cancel")
    wait(c, job, lambda v: v["state"] in ("cancelled", "succeeded", "failed"), "the end", timeout=120)


@pytest.fixture(scope="module")
def hosts(lab: Lab) -> dict[str, Host]:
    return {name: lab.host(name) for name in ("a", "b", "c")}


@pytest.fixture(scope="module")
def token(head: Head) -> str:
    return head.join_token()


def test_a_host_with_a_join_token_only_joins_and_the_next_gang_trains_across_two_hosts(
        head: Head, hosts: dict[str, Host], token: str) -> None:
    with head.client() as c:  # the admin's own token is no join token; a revoked join token joins nothing
        body = {"hostname": "x", "address": "10.0.0.1"}
        assert httpx.post(f"{head.url}/v1/nodes/join", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {head.admin}"}).status_code == 401
        revoked = c.post("/v1/join-tokens", json={"note": "to revoke"}).json()
        assert c.delete(f"/v1/join-tokens/{revoked['token']['id']}").status_code == 204
        assert httpx.post(f"{head.url}/v1/nodes/join", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {revoked['secret']}"}).status_code == 401

        head.join(hosts["a"], token)  # one at a time: a node starting beside another is slower to register
        head.wait_alive([hosts["a"]])
        head.join(hosts["b"], token)
        ids = head.wait_alive([hosts["a"], hosts["b"]])
        named = {n["hostname"]: n["address"] for n in head.nodes() if n["alive"]}
        assert named[hosts["a"].hostname] == hosts["a"].address  # named by host name and address, not a Ray id
        other = {"Authorization": f"Bearer {head.join_token()}"}  # another machine's: it takes host a's node nowhere
        host_a = {"hostname": hosts["a"].hostname, "address": hosts["a"].address}
        assert httpx.post(f"{head.url}/v1/nodes/leave", json=host_a, headers=other, timeout=30).status_code == 403
        assert httpx.post(f"{head.url}/v1/nodes/join", json=host_a, headers=other, timeout=30).status_code == 409

        job = submit(c, tiny(training={"epochs": 4}, resources=GANG), "across")
        done = wait(c, job, lambda v: v["state"] in ("succeeded", "failed", "cancelled"), "the end", timeout=300)
        assert done["state"] == "succeeded", done
    assert sorted(placed_hosts(head, job)) == sorted(ids), placed_hosts(head, job)  # one rank on each host
    assert epochs_of(head, job) == [0, 1, 2, 3]


def running_with_a_checkpoint(c: httpx.Client, head: Head, spec: dict[str, Any], name: str) -> str:
    """A job of ``spec`` submitted, once it ran 3 epochs and has a checkpoint in the bucket (one every
    TLAB_CHECKPOINT_EVERY_S, 2 s)."""
    job = submit(c, spec, name)
    wait(c, job, lambda v: (v["progress"].get("epoch") or 0) >= 3, "3 epochs")
    stored = Bucket(head.bucket)
    wait(c, job, lambda v: any(n.startswith("checkpoint_") for n in stored.ls(job)), "a checkpoint in the bucket")
    return job


def requeued_and_resumed(c: httpx.Client, head: Head, job: str, since: float) -> tuple[float, float]:
    """Seconds from ``since`` to the job queued again, and to its first epoch once started again."""
    wait(c, job, lambda v: v["state"] == "queued" or v["preemptions"] >= 1, "a requeue", timeout=120)
    queued = time.monotonic() - since
    seen = len(epochs_of(head, job))
    wait(c, job, lambda v: len(events(head.redis, job, "start")) >= 2 and len(epochs_of(head, job)) > seen,
         "a resumed epoch", timeout=240)
    return queued, time.monotonic() - since


def resumed_every_epoch_once(head: Head, job: str) -> list[int]:
    """The job's epochs, each once across its requeue, its second start resumed from the bucket's checkpoint."""
    epochs = epochs_of(head, job)
    assert epochs == list(range(len(epochs))), epochs
    starts = events(head.redis, job, "start")
    assert len(starts) == 2 and starts[1]["resumed_from_epoch"] >= 1, starts
    return epochs


def lose_a_host_mid_run(head: Head, hosts: dict[str, Host], how: str) -> tuple[Host, dict[str, float]]:
    """A 2-rank gang on two of the three hosts; one of its hosts killed or cut off after 3 epochs. Returns that host
    and the seconds from the loss to the node declared lost (the job stopped), to the job queued again, and to its
    first epoch on the hosts left; the job is cancelled, every epoch once."""
    with head.client() as c:
        job = running_with_a_checkpoint(c, head, tiny(training=LONG, resources=GANG), f"lose-{how}")
        victim = next(h for h in hosts.values() if h.hostname in placed_hosts(head, job))
        lost_at = time.monotonic()
        if how == "kill":
            victim.kill()
        with victim.cut_off() if how == "cut" else contextlib.nullcontext():
            deadline = time.monotonic() + 120
            while not (head.redis.hget(keys.job(job), PREEMPTED_BY) or "").startswith("the loss of node"):
                assert time.monotonic() < deadline, f"{how}: the node's loss never declared; {view(c, job)}"
                time.sleep(0.1)
            declared = time.monotonic() - lost_at
            queued, resumed = requeued_and_resumed(c, head, job, lost_at)
            v = view(c, job)
            assert victim.hostname in v["last_preemption"], v  # the loss names the host, not a Ray id
            assert victim.hostname not in placed_hosts(head, job)
        if how == "cut":  # healed: its old attempt may still be running there, and must not add epochs
            time.sleep(5)
        end(c, job)
    epochs = resumed_every_epoch_once(head, job)
    figures = {"declared_lost_s": round(declared, 1), "requeued_s": round(queued, 1),
               "first_resumed_epoch_s": round(resumed, 1)}
    print(f"\nhost {how}: {figures} (epochs {len(epochs)}; {v['last_preemption']})")
    return victim, figures


def leave(host: Host, log: Path) -> subprocess.Popen:
    """``tlab leave`` run on ``host`` as its admin would, from the node's home, its output to ``log``."""
    return host.run([TLAB_CLI, "leave"], {"PATH": "/usr/bin:/bin", "TLAB_HOME": NODE_HOME}, log)


def test_a_host_killed_mid_run_its_gang_resumes_on_the_hosts_left_every_epoch_once(
        head: Head, hosts: dict[str, Host], token: str) -> None:
    head.join(hosts["c"], token)
    head.wait_alive(list(hosts.values()))
    victim, _ = lose_a_host_mid_run(head, hosts, "kill")
    assert not any(n["alive"] for n in head.nodes() if n["hostname"] == victim.hostname)  # kept, as dead
    victim.boot()  # the machine comes back, and its admin joins it again
    head.join(victim, token)
    head.wait_alive([victim])


def test_a_host_cut_off_mid_run_is_declared_lost_within_20_s_and_rejoins_once_healed(
        head: Head, hosts: dict[str, Host]) -> None:
    head.wait_alive(list(hosts.values()))
    victim, figures = lose_a_host_mid_run(head, hosts, "cut")
    assert figures["declared_lost_s"] <= LOST_WITHIN_S, figures
    head.wait_alive([victim], timeout=180)  # its `tlab join` restarts the node Ray declared dead
    leaving = head.logs / "leave.log"
    out = leave(victim, leaving)
    assert out.wait(timeout=90) == 0, leaving.read_text()
    assert head.joins[victim.name].wait(timeout=30) == 0  # its `tlab join` stopped its node and exited
    # out, not lost: neither its node that left nor the one cut off before it rejoined is listed
    wait_for(lambda: not any(n["hostname"] == victim.hostname for n in head.nodes()), 60,
             lambda: f"the host that was cut off, joined again and left is still listed: {head.nodes()}")


def test_a_host_that_leaves_mid_run_has_its_job_moved_which_resumes_elsewhere_every_epoch_once(
        head: Head, hosts: dict[str, Host], token: str) -> None:
    rejoin_any_left(head, hosts, token)
    with head.client() as c:
        job = running_with_a_checkpoint(c, head, tiny(training=LONG), "leave")  # 1 worker: its driver trains
        victim = next(h for h in hosts.values() if h.hostname in placed_hosts(head, job))
        leaving = head.logs / "leave-drain.log"
        asked_at = time.monotonic()
        out = leave(victim, leaving)
        ended: list[float] = []  # when `tlab leave` returned (timed beside the job's requeue and resume)
        waiter = threading.Thread(target=lambda: (out.wait(timeout=240), ended.append(time.monotonic())), daemon=True)
        waiter.start()
        queued, resumed = requeued_and_resumed(c, head, job, asked_at)
        waiter.join(timeout=240)
        assert out.poll() == 0 and ended, leaving.read_text()
        left = ended[0] - asked_at
        assert head.joins[victim.name].wait(timeout=30) == 0  # its `tlab join` stopped its node and exited
        said = leaving.read_text()
        assert f"moved ({job})" in said, said  # `tlab leave` says what moved
        v = view(c, job)
        assert f"the node {victim.hostname} ({victim.address}) leaving" in v["last_preemption"], v
        assert v["preemptions"] == 1 and victim.hostname not in placed_hosts(head, job)
        logs = [m["message"] for m in events(head.redis, job, "log")]
        assert any(f"{victim.hostname} ({victim.address}) leaving: its admin took it out" in m for m in logs), logs
        assert not any("the loss of node" in m for m in logs), logs  # nothing was declared lost
        wait_for(lambda: not any(n["hostname"] == victim.hostname for n in head.nodes()), 60,  # neither alive nor dead
                 lambda: f"the node that left is still listed: {head.nodes()}")
        end(c, job)
    epochs = resumed_every_epoch_once(head, job)
    figures = {"requeued_s": round(queued, 1), "first_resumed_epoch_s": round(resumed, 1),
               "tlab_leave_done_s": round(left, 1)}
    print(f"\nhost leaves: {figures} (epochs {len(epochs)}; {v['last_preemption']})\n{said}")


def pulled(head: Head, job: str, to: Path) -> dict[str, str]:
    """``tlab pull`` of the job into ``to`` (it checks each file against the job's SHA256SUMS): name -> sha256."""
    out = subprocess.run([TLAB_CLI, "--url", head.url, "--token", head.admin, "pull", job, "-o", str(to)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(to.iterdir()) if p.is_file()}


def rejoin_any_left(head: Head, hosts: dict[str, Host], token: str) -> None:
    """Every host healed, joined and alive again (a test before may have made one leave, or failed while it was cut;
    run alone, none joined yet): one at a time, as a node starting beside another is slower to register. A host the
    head does not list within 3 minutes is said in full (the test output is the only record), rebooted and joined
    again, as its admin would: one host's fault is the test's that caused it, not every later test's."""
    for host in hosts.values():
        host.heal()
        if host.name not in head.joins or head.joins[host.name].poll() is not None:
            head.join(host, token)
        try:
            head.wait_alive([host], timeout=180)
        except AssertionError:
            print(f"\nhost {host.name} not alive 3 minutes after its `tlab join`; rebooted and joined again. It said:\n"
                  f"{head.said(host)}", flush=True)
            host.kill()  # every process on it, its `tlab join` too
            host.boot()
            head.join(host, token)
            head.wait_alive([host], timeout=180)


def test_a_host_cut_off_whose_job_then_succeeded_lands_nothing_once_healed(
        head: Head, hosts: dict[str, Host], token: str, tmp_path: Path) -> None:
    rejoin_any_left(head, hosts, token)
    with head.client() as c:
        job = submit(c, tiny(training=CUT_THEN_SUCCEED, resources=GANG), "cut-then-succeed")
        wait(c, job, lambda v: (v["progress"].get("epoch") or 0) >= 3, "3 epochs")
        stored = Bucket(head.bucket)
        wait(c, job, lambda v: any(n.startswith("checkpoint_") for n in stored.ls(job)), "a checkpoint in the bucket")
        victim = next(h for h in hosts.values() if h.hostname in placed_hosts(head, job))
        assert victim.running(b"workers.payload"), "no training process of its attempt on the host it was placed on"
        with victim.cut_off():
            done = wait(c, job, lambda v: v["state"] in ("succeeded", "failed", "cancelled"), "the end", timeout=600)
            assert done["state"] == "succeeded" and done["preemptions"] >= 1, done
            assert victim.hostname not in placed_hosts(head, job)
            before = pulled(head, job, tmp_path / "before")
            objects, epochs = stored.ls(job), epochs_of(head, job)
            summary = head.redis.hget(keys.job(job), "summary")
        # healed: its old attempt still runs there, with a stale checkpoint and an export to make
        deadline = time.monotonic() + 120
        # it learns its attempt ended and ends itself: its training processes, and rank 0's driver (the only writer
        # of a gang's files and records) when that was on the host
        while victim.running(b"workers.payload") or victim.running(b"workers.run"):
            assert time.monotonic() < deadline, "the cut-off attempt never ended itself once healed"
            time.sleep(0.5)
        after = pulled(head, job, tmp_path / "after")
        assert after == before and {"model.safetensors", "checkpoint.pt", "SHA256SUMS"} <= set(after)
        assert stored.ls(job) == objects  # no stale upload, no prune: the bucket is as the live attempt left it
        assert epochs_of(head, job) == epochs == list(range(CUT_THEN_SUCCEED["epochs"]))
        assert head.redis.hget(keys.job(job), "summary") == summary and view(c, job)["state"] == "succeeded"
    assert json.loads((tmp_path / "after" / "summary.json").read_text())["epochs"] == CUT_THEN_SUCCEED["epochs"]


def test_the_serving_hosts_redis_restarted_while_two_hosts_train_the_gang_goes_on(
        head: Head, hosts: dict[str, Host], token: str) -> None:
    rejoin_any_left(head, hosts, token)
    with head.client() as c:
        job = submit(c, tiny(training=LONG, resources=GANG), "redis-restart")
        wait(c, job, lambda v: (v["progress"].get("epoch") or 0) >= 3, "3 epochs")
        redis_server = next(p for p in psutil.Process(head.up).children(recursive=True) if p.name().startswith("redis"))
        redis_server.kill()
        deadline = time.monotonic() + 60
        while True:  # tlab up starts it again, on the same port, with what it had saved
            try:
                head.redis.ping()
                break
            except redis.RedisError:
                assert time.monotonic() < deadline, "Redis never came back"
                time.sleep(0.2)
        seen = len(epochs_of(head, job))
        wait(c, job, lambda v: len(epochs_of(head, job)) >= seen + 5, "epochs after Redis came back", timeout=120)
        v = view(c, job)
        assert v["state"] == "running" and v["preemptions"] == 0, v  # the same attempt went on: nothing requeued
        end(c, job)
    epochs = epochs_of(head, job)
    assert epochs == list(range(len(epochs))), epochs


def test_a_4_trial_sweep_spreads_over_the_hosts(head: Head, hosts: dict[str, Host], token: str) -> None:
    rejoin_any_left(head, hosts, token)
    body = {"base": tiny(training={"epochs": 3}), "search_space": {"teleport.lr": {"grid": [0.01, 0.03, 0.1, 0.3]}},
            "max_concurrent_trials": 3}
    with head.client() as c:
        r = c.post("/v1/sweeps", json=body)
        assert r.status_code == 201, r.text
        sweep = r.json()["id"]
        STARTED.append(f"sweeps/{sweep}")
        deadline = time.monotonic() + 600
        while (got := c.get(f"/v1/sweeps/{sweep}").json())["job"]["state"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, got
            time.sleep(1)
        logs = c.get(f"/v1/experiments/{sweep}/logs").text
        assert got["job"]["state"] == "succeeded", (got["job"]["failure_reason"], logs[-3000:])
        assert len(got["trials"]) == 4 and all(t["state"] == "succeeded" for t in got["trials"]), got["trials"]
        firsts = [c.get(f"/v1/experiments/{sweep}/logs", params={"rank": f"trial-{t['trial']}"}).text.split("\n")[0]
                  for t in got["trials"]]  # "[tlab] trial-<id> of job <sweep>, attempt 1: pid N on <host>"
    ran_on = {h.hostname for h in hosts.values() for line in firsts if line.endswith(f" on {h.hostname}")}
    assert len(ran_on) >= 2, firsts  # 1-CPU hosts, three trials at a time: spread over the hosts


def test_a_joined_nodes_raylet_that_dies_is_back_once_the_head_lists_it_again(
        head: Head, hosts: dict[str, Host], token: str) -> None:
    rejoin_any_left(head, hosts, token)
    host = hosts["a"]
    before = head.wait_alive([host])[host.hostname]
    said = head.logs / f"join-{host.name}.log"
    lines = len(said.read_text().splitlines())
    raylets = [p for p in (psutil.Process(pid) for pid in host.running(b"raylet"))
               if p.name() == "raylet" and p.status() != psutil.STATUS_ZOMBIE]
    assert raylets, "no raylet on the host"
    for p in raylets:
        p.kill()
    deadline = time.monotonic() + 120
    while True:  # `tlab join` restarts Ray, and says it is back only once the head's GCS lists the new node alive
        new = [line for line in said.read_text().splitlines()[lines:] if line.startswith("ray is back")]
        if new:
            break
        assert time.monotonic() < deadline, head.said(host)
        time.sleep(0.2)
    joined = json.loads((Path(f"/proc/{host.init_pid()}/root") / NODE_HOME.lstrip("/") / "node" / "joined.json")
                        .read_text())  # the restarted node's GCS and temp dir: asked of the GCS at once, no waiting
    ray_token = (head.logs / "home" / "ray.token").read_text().strip()
    listed = subprocess.run([sys.executable, "-m", "service.stack.ray_registered", joined["gcs"], joined["temp"], "0"],
                            env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": ray_token},
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    deadline = time.monotonic() + 30  # the service's view of the cluster: the scheduler's, a tick behind the GCS
    while not {n["id"] for n in head.nodes() if n["hostname"] == host.hostname and n["alive"]} - {before}:
        assert time.monotonic() < deadline, head.said(host)
        time.sleep(0.2)
