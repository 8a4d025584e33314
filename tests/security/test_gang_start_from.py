"""Red team: where a continued or forked job starts from, steered by what a job can write.

A job's Redis user may write its own copy of its record (``keys.job_run``), and its storage. Job B plants
``checkpoint_evil -> <victim>/artifacts`` in its own directory; a running gang rewrites ``start_from`` in its copy to
name it, and kills a rank so that the retry's ranks start again. The ranks start from what the driver decided once
from the service's record (a task argument), never from the rewritten copy; and a record naming a link, a path
outside storage, or another shape of path is refused. A fork or continue of another user's experiment is refused
by the API. Real Redis, real files (``workers.job.start_from``, ``workers.on_ray.gang_start``,
``workers.on_ray.supervisor.supervise_rank``'s resolution), the real API for the fork."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from api_schemas import gate, keys
from api_schemas.lineage import StartFrom
from tests.service.api.test_lineage_api import ended_parent
from tests.service.conftest import Api, api_env, api_only  # noqa: F401 (fixtures)
from workers.job.start_from import resolve_start, start_checkpoint

GANG, PARENT, ATTACKER, VICTIM = (f"18f3a2b4c5d-00000{i}" for i in range(4))
CKPT = "checkpoint_2026-01-01_00-00-00.000000"


def storage_of(tmp_path: Path) -> Path:
    """The parent's checkpoint (the service recorded it), the victim's weights, and job B's planted link."""
    storage = tmp_path / "storage"
    (storage / PARENT / CKPT).mkdir(parents=True)
    (storage / PARENT / CKPT / "checkpoint.pt").write_bytes(b"the parent's weights")
    (storage / VICTIM / "artifacts").mkdir(parents=True)
    (storage / VICTIM / "artifacts" / "checkpoint.pt").write_bytes(b"the victim's weights")
    (storage / ATTACKER).mkdir()
    (storage / ATTACKER / "checkpoint_evil").symlink_to(storage / VICTIM / "artifacts")
    return storage


def record(client: redis.Redis, key: str, start: StartFrom, copy: bool) -> None:
    fields = {"start_from": start.model_dump_json(), **({keys.JOB_RUN_MARK: GANG} if copy else {})}
    client.hset(key, mapping=fields)


def test_a_rewritten_start_from_never_reaches_a_rank(redis_server: str, tmp_path: Path) -> None:
    storage = storage_of(tmp_path)
    client = redis.Redis.from_url(redis_server, decode_responses=True)
    service = StartFrom(job=PARENT, epoch=1, checkpoint=CKPT)
    record(client, keys.job(GANG), service, copy=False)  # the API's record: the job's user cannot write it
    record(client, keys.job_run(GANG), service, copy=True)  # the scheduler's copy, before the submit
    decided = start_checkpoint(client, GANG, storage)  # the driver (workers.run), before any payload runs
    assert decided == storage / PARENT / CKPT

    # the job rewrites its copy (its user may), then a rank dies and the retry's ranks start
    planted = StartFrom(job=ATTACKER, epoch=1, checkpoint="checkpoint_evil")
    record(client, keys.job_run(GANG), planted, copy=True)
    for rank in (1, 2):  # each rank resolves the driver's task argument on its node: the service's checkpoint
        assert resolve_start(storage, GANG, str(decided)) == storage / PARENT / CKPT, rank

    # whoever reads the rewritten copy gets a refusal, never the victim's directory
    with pytest.raises(gate.Refused, match="link"):
        start_checkpoint(client, GANG, storage)
    for named in (storage / ATTACKER / "checkpoint_evil", storage / VICTIM / "artifacts", "/etc",
                  f"{storage}/{PARENT}/../{VICTIM}/artifacts", storage / PARENT, storage / PARENT / CKPT / "x"):
        with pytest.raises(gate.Refused):
            resolve_start(storage, GANG, str(named))
    client.hset(keys.job_run(GANG), "start_from", json.dumps({"job": f"/../../{VICTIM}", "epoch": 1,
                                                              "checkpoint": "artifacts"}))
    with pytest.raises(gate.Refused, match="start_from refused"):
        start_checkpoint(client, GANG, storage)
    client.close()


def test_a_start_checkpoint_whose_file_is_a_link_is_no_start(redis_server: str, tmp_path: Path) -> None:
    storage = storage_of(tmp_path)
    (storage / PARENT / CKPT / "checkpoint.pt").unlink()
    (storage / PARENT / CKPT / "checkpoint.pt").symlink_to(storage / VICTIM / "artifacts" / "checkpoint.pt")
    with pytest.raises(ValueError, match="is gone"):
        resolve_start(storage, GANG, str(storage / PARENT / CKPT))


def test_a_fork_or_continue_of_another_users_experiment_is_refused(api_only: Api) -> None:  # noqa: F811
    api_only.add_user("ann")
    api_only.add_user("bob")
    with api_only.client("ann") as ann, api_only.client("bob") as bob:
        parent = ended_parent(api_only, ann, [2, 3])
        for route, body in [("continue", {"epochs": 2}), ("fork", {"from_epoch": 2})]:
            r = bob.post(f"/v1/experiments/{parent}/{route}", json=body)
            assert r.status_code == 403 and "another user" in r.text, r.text
        # ann's job planted its newest "checkpoint" as a link to bob's run: her continuation starts from her own
        storage = api_only.stack.home / "storage"
        bobs = ended_parent(api_only, bob, [5])
        (storage / parent / "checkpoint_2099-01-01_00-00-00.000000").symlink_to(
            next(p for p in (storage / bobs).iterdir() if p.name.startswith("checkpoint_")))
        r = ann.post(f"/v1/experiments/{parent}/continue", json={"epochs": 2})
        assert r.status_code == 201, r.text
        client = redis.Redis.from_url(api_only.stack.redis_url or "", decode_responses=True)
        start = StartFrom.model_validate_json(client.hget(keys.job(r.json()["id"]), "start_from") or "")
        client.close()
        assert (start.job, start.epoch) == (parent, 3)
        assert gate.real_dir(storage, start.job, start.checkpoint) == start.path(storage)
