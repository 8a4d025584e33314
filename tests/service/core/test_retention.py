"""``TLAB_HISTORY_DAYS`` (service.core.retention): an ended job is deleted with its files once its end is older than
that, as ``DELETE`` would; a job that has not ended, one that ended inside the window, and the parent of a child
that has not ended all stay. On a real Redis through the API; the scheduler runs ``expire`` from its tick."""

from __future__ import annotations

import json
import time

from api_schemas import keys
from service.core import retention, storage_lifecycle
from service.core.settings import Settings
from service.core.store import Store
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
