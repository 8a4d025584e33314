"""The small leaks: a waiting job's reason names no other user's job; listing artifacts reads no file a job wrote
but the export's bounded SHA256SUMS; a webhook to an IPv6 form of an internal IPv4 address is refused.

The API is real (``api_only``: real Redis, real HTTP, no Ray). The reasons are the scheduler's: it runs here on
the same Redis, its ``Launcher`` seam in place of Ray's Jobs API (a policy test, as ``test_fair_share.py``; the
same preemption on real Ray: ``tests/service/scheduler/test_preemption.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from service.core.settings import Settings
from service.core.store import Store
from service.launch.ray_cluster import StaticCluster
from service.rules import webhooks
from service.scheduler.tick import Scheduler
from tests.service import conftest as service
from tests.service.conftest import Api, tiny
from tests.service.scheduler.test_fair_share import Jobs  # Ray's Jobs API as the scheduler sees it
from workers.job.artifacts import record_digests

api_env, api_only = service.api_env, service.api_only  # the service fixtures, reused

NODE = json.dumps([{"id": "n", "cpus": 2, "gpus": 0}])
WHOLE = tiny(resources={"cpus_per_worker": 2})  # the whole node
HALF = tiny(resources={"cpus_per_worker": 1})
THEIRS = "another user's job"
SPARSE = 20 << 30  # bytes of a sparse file: no disk, and no reading it either


def scheduler(api: Api) -> Scheduler:
    store = Store.from_url(api.stack.redis_url or "")
    return Scheduler(store, Settings(redis_url=api.stack.redis_url, cluster_nodes=NODE), StaticCluster(NODE), Jobs())


def tick(sched: Scheduler, now: float) -> None:
    sched.reconcile(now)
    sched.dispatch(now)


def submit(api: Api, user: str, spec: dict, priority: int = 0) -> str:
    with api.client(user) as c:
        r = c.post("/v1/experiments", json={"spec": spec, "priority": priority})
        assert r.status_code == 201, r.text
        return r.json()["id"]


def view(api: Api, user: str, job: str) -> dict:
    with api.client(user) as c:
        return c.get(f"/v1/experiments/{job}").raise_for_status().json()


# ---- another user's job id in a waiting job's reason --------------------------------------------------------


def test_a_pending_reason_names_only_the_readers_own_jobs(api_only: Api) -> None:
    api_only.add_user("ann")
    api_only.add_user("bob")
    sched = scheduler(api_only)
    running = submit(api_only, "ann", WHOLE)
    tick(sched, 1000.0)  # ann's job takes the node; bob's first waits for it and reserves it
    big, small = submit(api_only, "bob", WHOLE), submit(api_only, "bob", HALF)
    mine = submit(api_only, "ann", HALF)
    tick(sched, 1001.0)
    assert view(api_only, "ann", running)["state"] == "running"
    ann_reason = view(api_only, "ann", mine)["pending_reason"]
    assert ann_reason == f"behind {THEIRS}, which is next and waiting for room", ann_reason
    assert big not in ann_reason
    assert view(api_only, "bob", small)["pending_reason"] == f"behind {big}, which is next and waiting for room"
    with api_only.client("ann") as c:  # the queue shows another user's job without its id or reason, as before
        queue = c.get("/v1/queue").raise_for_status().json()["items"]
    assert big not in json.dumps(queue) and {e["pending_reason"] for e in queue if e["id"] == mine} == {ann_reason}


def test_a_preemption_names_no_other_users_job_to_either_owner(api_only: Api) -> None:
    api_only.add_user("ann", max_priority=5)
    api_only.add_user("bob")
    sched = scheduler(api_only)
    victim = submit(api_only, "bob", WHOLE)
    tick(sched, 1000.0)
    tick(sched, 1001.0)  # running
    urgent = submit(api_only, "ann", WHOLE, priority=5)
    tick(sched, 1002.0)  # no room: bob's job is preempted for it
    reason = view(api_only, "ann", urgent)["pending_reason"]
    assert f"; preempting {THEIRS} (priority 0): waiting" in reason and victim not in reason, reason
    tick(sched, 1003.0)  # Ray reports it stopped: back to the queue
    seen = view(api_only, "bob", victim)
    assert seen["last_preemption"].startswith(f"preempted by {THEIRS} (priority 5) at "), seen
    with api_only.client("bob") as c:
        logs = c.get(f"/v1/experiments/{victim}/logs").text
    assert f"preempted by {THEIRS} (priority 5): checkpointing" in logs and urgent not in logs, logs


# ---- artifacts: listed from the export's digests, never hashed on a request ----------------------------------


def read_bytes_of(pid: int | str) -> int:
    """Bytes the process has read through read() and its kin so far (``rchar``: page cache and holes too)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["rchar"])


def artifacts_with_a_huge_file(out: Path) -> bytes:
    """``out`` as a job leaves it: its weights, a 20 GiB sparse file, a link to a file outside, and a linked
    directory; returns the weights."""
    out.mkdir(parents=True)
    weights = os.urandom(4096)
    (out / "model.safetensors").write_bytes(weights)
    with (out / "huge.bin").open("wb") as f:
        f.truncate(SPARSE)
    secret = out.parent.parent / "secret.txt"
    secret.write_text("not the job's")
    (out / "leak.txt").symlink_to(secret)
    (out / "linked").symlink_to(secret.parent, target_is_directory=True)
    return weights


def test_the_export_hashes_bounded_and_follows_no_link(tmp_path: Path) -> None:
    out = tmp_path / "storage" / "job" / "artifacts"
    weights = artifacts_with_a_huge_file(out)
    before = read_bytes_of("self")
    assert record_digests(out) == ["huge.bin"]
    assert read_bytes_of("self") - before < 1 << 20  # the weights and the directories: not the 20 GiB
    sums = (out / "SHA256SUMS").read_text().splitlines()
    assert f"{hashlib.sha256(weights).hexdigest()}  model.safetensors" in sums
    assert f"# not hashed: huge.bin ({SPARSE} bytes): over 4 GiB" in sums
    assert not any("leak.txt" in line or "linked" in line or "secret" in line for line in sums), sums


def test_listing_artifacts_reads_the_recorded_digests_and_no_file(api_only: Api) -> None:
    api_only.add_user("ann")
    job = submit(api_only, "ann", HALF)
    out = api_only.stack.home / "storage" / job / "artifacts"
    weights = artifacts_with_a_huge_file(out)
    record_digests(out)
    (out / "model.safetensors").write_bytes(bytes(len(weights)))  # changed since: the listing does not notice
    api = api_only.stack.procs["api"].pid
    before = read_bytes_of(api)
    with api_only.client("ann") as c:
        items = {a["name"]: a for a in c.get(f"/v1/experiments/{job}/artifacts").raise_for_status().json()["items"]}
    assert read_bytes_of(api) - before < 1 << 20  # SHA256SUMS, a request, a few Redis answers
    assert set(items) == {"model.safetensors", "huge.bin", "SHA256SUMS"}, items  # no link
    assert items["model.safetensors"]["sha256"] == hashlib.sha256(weights).hexdigest()  # recorded, not computed
    assert "in SHA256SUMS, by the job's supervisor" in items["model.safetensors"]["sha256_note"]
    assert items["huge.bin"]["sha256"] is None and items["huge.bin"]["bytes"] == SPARSE
    assert items["huge.bin"]["sha256_note"] == "none: over the 4 GiB the export hashes per file"


# ---- webhooks to an IPv6 form of an internal IPv4 address -----------------------------------------------------

SLIPPED = {  # internal, yet each passed as a public IPv6 address
    "64:ff9b::7f00:1": "NAT64 of 127.0.0.1", "64:ff9b::a9fe:a9fe": "NAT64 of 169.254.169.254",
    "64:ff9b::a00:1": "NAT64 of 10.0.0.1", "64:ff9b:1::808:808": "local-use NAT64 (the site's own translator)",
    "64:ff9b:1::7f00:1": "local-use NAT64 of 127.0.0.1", "2002:7f00:1::": "6to4 of 127.0.0.1",
    "2002:a9fe:a9fe::1": "6to4 of 169.254.169.254", "2002:c0a8:1::1": "6to4 of 192.168.0.1",
    "::7f00:1": "IPv4-compatible 127.0.0.1", "::ffff:0:7f00:1": "IPv4-translated 127.0.0.1",
}
HELD = {  # judged right before as now: refused, or public
    "::ffff:127.0.0.1": True, "::ffff:10.1.2.3": True, "2001:0:4136:e378:8000:63bf:80ff:fffe": True, "::1": True,
    "::ffff:8.8.8.8": False, "64:ff9b::808:808": False, "2002:808:808::1": False, "2606:4700:4700::1111": False,
}


@pytest.mark.parametrize("address", sorted(SLIPPED))
def test_a_webhook_to_an_ipv6_form_of_an_internal_address_is_refused(address: str) -> None:
    assert webhooks.internal(address), SLIPPED[address]
    why = webhooks.refusal(Settings(), f"http://[{address}]:8265/api/jobs/", unresolved_ok=False)
    assert "loopback, link-local or private" in why, why


@pytest.mark.parametrize("address", sorted(HELD))
def test_the_ipv4_inside_decides_both_ways(address: str) -> None:
    assert webhooks.internal(address) is HELD[address]


def test_submitting_a_nat64_webhook_is_refused_naming_the_field(api_only: Api) -> None:
    with api_only.client() as c:
        r = c.post("/v1/experiments", json={"spec": HALF, "notify": {"webhook": "http://[64:ff9b::7f00:1]:6379/"}})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "notify.webhook", r.text
