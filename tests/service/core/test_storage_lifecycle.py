"""Storage lifecycle without Ray (service.core.storage_lifecycle): an ended experiment keeps its newest checkpoint (and
any a child names), its size counts against its owner once, a user at their max_storage_gb is refused at submit
with the figure, `GET /v1/me` shows the use, and a delete gives it back. The real run's prune is in
test_driver_death."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from api_schemas import keys
from service.core import storage_lifecycle
from service.core.settings import Settings
from service.core.store import Store
from tests.service.conftest import Api, tiny


def checkpoint(storage: Path, job: str, name: str, epoch: int | None, size: int = 1000) -> None:
    d = storage / job / name
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"epoch": epoch}))
    if epoch is not None:  # a diverged run's last one holds only its failure
        (d / "checkpoint.pt").write_bytes(b"x" * size)


def ended_job(c: httpx.Client) -> str:
    job = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
    assert c.post(f"/v1/experiments/{job}/cancel").json()["state"] == "cancelled"
    return job


def test_an_ended_job_keeps_its_newest_checkpoint_and_its_size_counts_once(api_only: Api, redis_server: str) -> None:
    api_only.add_user("erin")
    storage = api_only.stack.home / "storage"
    settings, store = Settings(TLAB_HOME=str(api_only.stack.home), REDIS_URL=redis_server), Store.from_url(redis_server)
    with api_only.client("erin") as c:
        job, child = ended_job(c), ended_job(c)
        for i, epoch in enumerate((1, 2, 3)):
            checkpoint(storage, job, f"checkpoint_2026-01-0{i + 1}", epoch)
        checkpoint(storage, job, "checkpoint_2026-01-04", None)  # the failure marker: a few bytes, kept
        (storage / job / "artifacts").mkdir()
        (storage / job / "artifacts" / "model.safetensors").write_bytes(b"m" * 500)
        # a fork names the oldest (written by service.api.lineage when it was submitted): it stays too
        store.r.hset(keys.job(job), "children", json.dumps([child]))
        store.r.hset(keys.job(child), "start_from", json.dumps(
            {"job": job, "epoch": 1, "checkpoint": "checkpoint_2026-01-01"}))
        size = storage_lifecycle.prune_ended(store, settings, store.raw(job))
        kept = sorted(p.name for p in (storage / job).glob("checkpoint_*"))
        assert kept == ["checkpoint_2026-01-01", "checkpoint_2026-01-03", "checkpoint_2026-01-04"]
        assert size == 2 * 1000 + 500 + 2 * len(json.dumps({"epoch": 1})) + len(json.dumps({"epoch": None}))
        assert storage_lifecycle.prune_ended(store, settings, store.raw(job)) == size  # counted once
        assert c.get("/v1/me").json()["storage_used_gb"] == round(size / 1e9, 3)
        assert storage_lifecycle.used_bytes(store, "erin") == size


def test_a_user_at_their_storage_quota_is_refused_at_submit_until_they_delete(api_only: Api,
                                                                             redis_server: str) -> None:
    api_only.add_user("fay", max_storage_gb=0.000001)  # 1,000 bytes
    storage = api_only.stack.home / "storage"
    settings, store = Settings(TLAB_HOME=str(api_only.stack.home), REDIS_URL=redis_server), Store.from_url(redis_server)
    with api_only.client("fay") as c:
        job = ended_job(c)
        checkpoint(storage, job, "checkpoint_2026-01-01", 1, size=1500)
        storage_lifecycle.prune_ended(store, settings, store.raw(job))
        refused = c.post("/v1/experiments", json={"spec": tiny()})
        assert refused.status_code == 422, refused.text
        assert refused.json()["errors"][0]["field"] == "max_storage_gb"
        assert "your jobs hold 0.00 GB of storage, your max_storage_gb quota is 1e-06" in refused.json()["detail"]
        assert c.delete(f"/v1/experiments/{job}").status_code == 204
        assert storage_lifecycle.used_bytes(store, "fay") == 0
        assert c.post("/v1/experiments", json={"spec": tiny()}).status_code == 201


def test_tlab_cancel_then_rm_and_tlab_me_shows_the_storage(api_only: Api, tmp_path: Path) -> None:
    from tests.service.cli.tlab_process import tlab

    token = api_only.add_user("gus", max_storage_gb=5)
    env = {"TLAB_URL": api_only.url, "TLAB_TOKEN": token, "TLAB_HOME": str(tmp_path)}
    with api_only.client("gus") as c:
        job = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
        refused = tlab("rm", job, env=env)
        assert refused.returncode != 0 and "cancel it first" in refused.stderr, refused.stderr
        assert tlab("cancel", job, env=env).stdout.strip() == f"{job}  cancelled"
        assert tlab("rm", job, env=env).stdout.strip() == f"{job}  deleted"
        assert c.get(f"/v1/experiments/{job}").status_code == 404
    me = tlab("me", env=env)
    assert me.returncode == 0 and "  storage 0.00 GB of 5  at " in me.stdout, me.stdout


def test_a_requeued_job_cancelled_while_it_waits_is_pruned_and_counted(api_only: Api, redis_server: str) -> None:
    """A job that ran, was preempted back to the queue and was cancelled there never passes the scheduler's active
    set again: the cancel marks it (``keys.unsettled``) and the scheduler's next settle prunes and counts it. A job
    that never ran is not marked."""
    api_only.add_user("ida")
    storage = api_only.stack.home / "storage"
    settings, store = Settings(TLAB_HOME=str(api_only.stack.home), REDIS_URL=redis_server), Store.from_url(redis_server)
    with api_only.client("ida") as c:
        ran, fresh = (c.post("/v1/experiments", json={"spec": tiny()}).json()["id"] for _ in range(2))
        store.r.hset(keys.job(ran), "attempts", "1")  # it started once, then went back to the queue
        for i, epoch in enumerate((1, 2)):
            checkpoint(storage, ran, f"checkpoint_2026-01-0{i + 1}", epoch)
        for job in (ran, fresh):
            assert c.post(f"/v1/experiments/{job}/cancel").json()["state"] == "cancelled"
        assert store.r.smembers(keys.unsettled()) == {ran}
        storage_lifecycle.settle(store, settings, [])  # a tick with nothing active
        assert sorted(p.name for p in (storage / ran).glob("checkpoint_*")) == ["checkpoint_2026-01-02"]
        assert storage_lifecycle.used_bytes(store, "ida") == int(store.r.hget(keys.job(ran), "storage_bytes") or 0) > 0
        assert store.r.smembers(keys.unsettled()) == set()


def test_an_ended_sweeps_trials_keep_their_newest_checkpoint_and_no_link_is_followed(tmp_path: Path,
                                                                                     redis_server: str) -> None:
    """Tune kept 2 checkpoints a trial (4 under PBT) while the sweep ran; once it ended each trial keeps its newest.
    A trial's code wrote these directories: a link in place of a trial or a checkpoint leads nowhere."""
    settings, store = Settings(TLAB_HOME=str(tmp_path), REDIS_URL=redis_server), Store.from_url(redis_server)
    sweep = tmp_path / "storage" / "sweep-s1"
    for trial, names in (("train_a_00000", ("checkpoint_000008", "checkpoint_000009", "checkpoint_000010")),
                         ("train_b_00001", ("checkpoint_000003", "checkpoint_000004")),
                         ("train_c_00002", ())):
        for name in names:
            (sweep / trial / name).mkdir(parents=True)
            (sweep / trial / name / "checkpoint.pt").write_bytes(b"w" * 100)
        (sweep / trial).mkdir(parents=True, exist_ok=True)
    (sweep / "tuner.pkl").write_bytes(b"state")
    outside = tmp_path / "elsewhere"
    for name in ("checkpoint_000001", "checkpoint_000002"):
        (outside / name).mkdir(parents=True)
    (sweep / "train_d_00003").symlink_to(outside)  # a link in place of a trial
    (sweep / "train_b_00001" / "checkpoint_000000").symlink_to(outside / "checkpoint_000001")
    data = {"id": "s1", "kind": "sweep", "owner": "erin"}
    size = storage_lifecycle.prune_ended(store, settings, data)
    assert sorted(p.name for p in (sweep / "train_a_00000").iterdir()) == ["checkpoint_000010"]
    assert sorted(p.name for p in (sweep / "train_b_00001").iterdir()) == ["checkpoint_000000", "checkpoint_000004"]
    assert sorted(p.name for p in outside.iterdir()) == ["checkpoint_000001", "checkpoint_000002"]  # untouched
    assert (sweep / "tuner.pkl").exists() and (sweep / "train_c_00002").is_dir()
    assert size == 2 * 100 + len(b"state") and storage_lifecycle.used_bytes(store, "erin") == size
    assert storage_lifecycle.prune_trials(settings, "s1") == 0  # nothing more to go
