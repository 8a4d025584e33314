"""``TLAB_HISTORY_DAYS`` (service.core.retention): an ended job is deleted with its files once its end is older than
that, as ``DELETE`` would; a job that has not ended, one that ended inside the window, and the parent of a child
that has not ended all stay. ``TLAB_CODE_TTL_DAYS``: a code package no job refers to goes once its upload is that
old. On a real Redis through the API; the scheduler runs both from its tick."""

from __future__ import annotations

import json
import os
import time

from api_schemas import keys
from service.core import retention, storage_lifecycle
from service.core.settings import Settings
from service.core.store import Store
from tests.service.api.test_code_upload import ZIP, custom_spec, zip_of
from tests.service.conftest import Api, tiny
from tests.service.core.test_storage_lifecycle import checkpoint, ended_job

DAY = 86400.0


def test_ended_jobs_older_than_the_history_go_with_their_files_and_the_rest_stay(api_only: Api,
                                                                                redis_server: str) -> None:
    api_only.add_user("gil")
    home = api_only.stack.home
    storage, store = home / "storage", Store.from_url(redis_server)
    now = time.time()
    with api_only.client("gil") as c:
        old, parent, waiting = ended_job(c), ended_job(c), c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
        recent, child = ended_job(c), c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
        for job in (old, parent, waiting):  # created 10 days ago, ended (but the queued one) 9 days ago
            store.r.hset(keys.job(job), mapping={"created_at": repr(now - 10 * DAY),
                                                 "finished_at": repr(now - 9 * DAY)})
        store.r.hset(keys.job(waiting), "finished_at", "")
        store.r.hset(keys.job(recent), "finished_at", repr(now - 1 * DAY))
        store.r.hset(keys.job(parent), "children", json.dumps([child]))  # a fork that has not run yet
        checkpoint(storage, old, "checkpoint_2026-01-01", 1, size=1500)
        outside = home / "precious.txt"
        outside.write_text("not the job's")
        (storage / old / "link").symlink_to(outside)  # a link the job planted: it goes, what it points at stays
        settings = Settings(TLAB_HOME=str(home), REDIS_URL=redis_server, TLAB_HISTORY_DAYS="7")
        size = storage_lifecycle.prune_ended(store, settings, store.raw(old))
        assert storage_lifecycle.used_bytes(store, "gil") == size > 1500

        assert retention.expire(store, Settings(TLAB_HOME=str(home), REDIS_URL=redis_server), now) == []  # unset
        assert c.get(f"/v1/experiments/{old}").status_code == 200
        assert retention.expire(store, settings, now) == [old]
        assert c.get(f"/v1/experiments/{old}").status_code == 404
        assert not (storage / old).exists() and outside.read_text() == "not the job's"
        assert storage_lifecycle.used_bytes(store, "gil") == 0
        assert not any(store.r.exists(k) for k in keys.job_keys(old))
        for job in (parent, waiting, recent, child):
            assert c.get(f"/v1/experiments/{job}").status_code == 200, job
        assert old not in [j["id"] for j in c.get("/v1/experiments").json()["items"]]

        assert c.post(f"/v1/experiments/{child}/cancel").json()["state"] == "cancelled"  # the child ends:
        assert retention.expire(store, settings, now) == [parent]  # its parent's checkpoint is no longer needed
        assert retention.expire(store, settings, now + 30 * DAY) == [recent, child]  # ended: now old too
        assert c.get(f"/v1/experiments/{waiting}").status_code == 200  # queued: never expires


def test_code_packages_no_job_refers_to_go_after_their_ttl(api_only: Api, redis_server: str) -> None:
    """A package a job (even an ended one) refers to stays; an unused one goes once its upload is older than
    TLAB_CODE_TTL_DAYS, with the scheduler's verified copy; uploading it again starts its time anew."""
    api_only.add_user("hal")
    home = api_only.stack.home
    store, code = Store.from_url(redis_server), home / "storage" / "code" / "hal"
    used_zip, idle_zip = zip_of({"model.py": b"A = 1\n"}), zip_of({"model.py": b"B = 2\n"})
    with api_only.client() as admin:
        assert admin.patch("/v1/users/hal", json={"can_submit_code": True}).status_code == 200
    with api_only.client("hal") as c:
        used, idle = (c.post("/v1/code", content=z, headers=ZIP).json()["package"] for z in (used_zip, idle_zip))
        job = c.post("/v1/experiments", json={"spec": custom_spec(used)}).json()["id"]
        assert c.post(f"/v1/experiments/{job}/cancel").json()["state"] == "cancelled"  # ended: still refers to it
        now = time.time()
        (home / "packages").mkdir(exist_ok=True)
        copy = home / "packages" / f"{idle[7:]}.zip"  # what the scheduler handed Ray once
        copy.write_bytes(idle_zip)
        for path in (*code.iterdir(), copy):
            os.utime(path, (now - 10 * DAY, now - 10 * DAY))
        settings = Settings(TLAB_HOME=str(home), REDIS_URL=redis_server, TLAB_CODE_TTL_DAYS="7")
        assert retention.expire_code(store, Settings(TLAB_HOME=str(home), REDIS_URL=redis_server), now) == []
        assert retention.expire_code(store, settings, now - 5 * DAY) == []  # 5 days old then: inside the TTL
        assert retention.expire_code(store, settings, now) == [f"code/hal/{idle[7:]}.zip"]
        assert sorted(p.name for p in code.iterdir()) == [f"{used[7:]}.zip"] and not copy.exists()
        assert c.get(f"/v1/code/{idle}").status_code == 404 and c.get(f"/v1/code/{used}").status_code == 200

        assert c.post("/v1/code", content=used_zip, headers=ZIP).status_code == 200  # uploaded again: anew
        assert c.delete(f"/v1/experiments/{job}").status_code == 204  # no job refers to it any more
        assert retention.expire_code(store, settings, now) == []
        assert retention.expire_code(store, settings, now + 8 * DAY) == [f"code/hal/{used[7:]}.zip"]
