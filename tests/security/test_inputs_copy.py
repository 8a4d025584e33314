"""Red team: a job plants its own inputs in the run copy its Redis user may write (``keys.job_run``).

The scheduler copies the job's inputs (``service.launch.job_acl.INPUTS``: spec, sweep, start_from, attempts) from the
job hash, which the job cannot write, into that copy, which its workers read (``workers.job.record.job_field``). A
``start_from`` the job planted there when its job hash has none, or an input it rewrote, is gone once the copy is made
again: by a restore after Redis lost its users, and by a resume's new credentials. Real redis-server, no Ray."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis

from api_schemas import keys
from api_schemas.jobs import ExperimentSubmit, JobState
from api_schemas.spec import ExperimentSpec
from service.core.settings import Settings
from service.core.store import Store
from service.launch.job_acl import JobAcl, job_url, user_name
from tests.service.conftest import tiny
from workers.job.record import job_field
from workers.job.ticket import redeem

PLANTED = json.dumps({"job": "18f3a2b4c5d-000003", "epoch": 1, "checkpoint": "checkpoint_evil"})


@pytest.fixture()
def service(redis_server: str) -> Iterator[tuple[Store, JobAcl]]:
    """The store and the scheduler's job users on a Redis with a password, as ``tlab up`` gives it."""
    redis.Redis.from_url(redis_server).config_set("requirepass", "service-secret")
    url = job_url(redis_server, "default", "service-secret")
    store = Store.from_url(url)
    yield store, JobAcl(store.r, Settings(redis_url=url))
    store.r.close()


def test_what_a_job_planted_in_its_run_copy_never_survives_the_next_copy(service: tuple[Store, JobAcl]) -> None:
    store, acl = service
    job, *_ = store.submit("alice", ExperimentSubmit(spec=ExperimentSpec.model_validate(tiny())))
    store.transition(job, JobState.STARTING, expect=[JobState.QUEUED], ray_job_id=f"tlab-{job}-1", attempts="1")
    url, run = redeem(acl.credentials(job, f"tlab-{job}-1")[keys.JOB_TICKET_ENV]), keys.job_run(job)
    inputs = store.r.hgetall(keys.job(job))
    assert "start_from" not in inputs and "sweep" not in inputs and inputs["spec"] and inputs["attempts"] == "1"

    def plant() -> None:  # as the job's own user, which may write its run copy
        own = redis.Redis.from_url(url, decode_responses=True)
        own.hset(run, mapping={"start_from": PLANTED, "sweep": "{}", "spec": "{}", "attempts": "99"})
        assert job_field(own, job, "start_from") == PLANTED  # what the job's driver would read, were it kept
        own.close()

    def exact() -> None:
        copy = store.r.hgetall(run)
        assert "start_from" not in copy and "sweep" not in copy, copy
        assert (copy["spec"], copy["attempts"]) == (inputs["spec"], inputs["attempts"])

    plant()
    store.r.execute_command("ACL", "DELUSER", user_name(job))  # a restarted Redis keeps no ACL users
    acl.sync()  # the user made again (the same password): the copy too
    exact()
    plant()
    acl.credentials(job, f"tlab-{job}-2")  # a resume's submission
    exact()
